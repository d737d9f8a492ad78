"""What torch.distributed gets back for an op: a Work and its Future, whose waits hand the rank's
compute slot back (RankClient.wait)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.futures import Future

if TYPE_CHECKING:
    from prism_megatron.runtime.client import RankClient


class PrismCommError(RuntimeError):
    """An op failed in the coordinator (mismatch, abort) or the coordinator went away."""


class OpToken:
    """What waiting on an op needs: its id and completion. Works and futures share it instead of
    pointing at each other: a Work <-> Future cycle kept every op's tensors alive until the cyclic GC
    ran — +80 to +176 MiB of peak allocated memory against NCCL on a TP2 job on the H200."""

    __slots__ = ("op_id", "done", "arrived", "waited")

    def __init__(self, op_id: int) -> None:
        self.op_id = op_id
        self.waited = False  # the program has waited for the op (told to the coordinator once)
        self.done = threading.Event()  # results written into the program's tensors (or failed)
        self.arrived = threading.Event()  # the coordinator completed the op; results not yet written


class PrismFuture(Future):
    """A future whose wait() gives the slot back like Work.wait(); so do futures chained by then()."""

    def __init__(self, client: RankClient, ops: list[OpToken]) -> None:
        super().__init__()
        self._client = client
        self._ops = ops

    def wait(self) -> Any:
        self._client.wait(self._ops)
        return super().wait()

    def then(self, callback: Any) -> PrismFuture:
        chained = super().then(callback)
        out = PrismFuture(self._client, self._ops)

        def forward(f: Future) -> None:
            try:
                out.set_result(f.value())
            except BaseException as e:  # the callback raised: the chained future carries it
                out.set_exception(e)

        chained.add_done_callback(forward)
        return out


class PrismWork(dist.Work):
    """A `Work` whose wait() hands the rank's slot back while it blocks (see RankClient.wait)."""

    def __init__(self, client: RankClient, op_id: int, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._client = client
        self._op = OpToken(op_id)
        self._result = result
        self._error: BaseException | None = None
        self._source: int = -1
        self._future: PrismFuture = PrismFuture(client, [self._op])
        #: run once the op's results are written, before the Work completes (a backend op whose result
        #: tensors are not the staged outputs copies them over: allgather_coalesced)
        self._after: Callable[[], None] | None = None

    @property
    def op_id(self) -> int:
        return self._op.op_id

    @property
    def _done(self) -> threading.Event:
        return self._op.done

    # completion, from the receiver thread (or at once for ops with nothing to wait for)
    def _finish(self, error: BaseException | None = None, source: int = -1) -> None:
        if error is None and self._after is not None:
            try:
                with torch.no_grad():
                    self._after()
            except Exception as e:  # a result that cannot be written is the op's failure, not a hang
                error = PrismCommError(f"writing the result of op {self.op_id} failed: {e}")
        self._error = error
        self._source = source
        self._op.arrived.set()
        self._done.set()
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - torch passes a timedelta
        self._client.wait([self._op])
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._op.arrived.is_set():
            self._client.deliver()  # a program polling for completion gets the results now
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future:
        # whoever holds the future may wait on it where prism cannot deliver (torch's C++ waits)
        self._client.make_eager(self._op)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source
