"""Messages between logical ranks, the launcher and the coordinator.

Control messages are plain dicts pickled over `multiprocessing.connection` (TCP, authenticated),
so ranks may later live on other hosts. Tensor bytes travel either inline (small payloads) or
through a shared-memory segment named in the message (the data plane, same host only).

A payload descriptor is a tuple:
- ``("i", data: bytes)``: input bytes inline.
- ``("s", segment: str, offset: int, nbytes: int)``: bytes in a rank's shared-memory segment.
- ``("r", nbytes: int)``: an output the coordinator returns inline in the reply.
- ``("l", nbytes: int)``: data that stays with the rank: an op of a group of one, whose result the rank
  computes itself (the message only records the op).
"""

from __future__ import annotations

import os

import torch

# rank -> coordinator
HELLO = "hello"  # {rank, pid, world_size}
GROUP = "group"  # {h, name, ranks, backend, world, timeout}: the rank made a group it calls h (runtime.groups);
#   timeout in seconds (the group's own), or None
OP = "op"  # an operation, see RankClient.submit
BLOCK = "block"  # {ids, mem, peak}: the rank waits for these ops; release its slot until they complete
WAITED = "waited"  # {ids}: the program waits for these ops for the first time (done or not; the trace's wait)
ACQUIRE = "acquire"  # the rank wants a slot (start of the program)
MARK = "mark"  # {name, phase, attrs}: a scheduling-unit marker
DROP = "drop"  # {segment}: the rank unlinked a shared-memory segment
BYE = "bye"  # {exit_code}: the rank's program ended
PREDICT = "predict"  # {iteration, mem, peak}: the rank waits for the predicted time of an iteration (slot released)
GPUTIME = "gputime"  # {rows}: host/device times of closed compute segments (runtime.gpu_timing)
RELEASE = "release"  # the rank gives its slot back while it idles (RankClient.idle); ACQUIRE asks again
DEVICE_OOM = "device_oom"  # {held, requested, free}: the physical device was full; answered by VERDICT
SWAPPED = "swapped"  # {op, ok, bytes, seconds, error, no_room}: the answer to SWAP, from the rank's receiver
ROOM = "room"  # {nbytes, free}: an allocation of the computing rank found its device full, free bytes left
#   (runtime.vmm); answered by ROOM_MADE

# coordinator -> rank
DONE = "done"  # {id, out: [bytes|None], src}
ERROR = "error"  # {id, message, timed_out}: the op failed (timed_out: its process group's timeout)
GRANT = "grant"  # the rank holds a slot again
PREDICTED = "predicted"  # {iteration, seconds | None, note}: answer to PREDICT (a GRANT follows)
ABORT = "abort"  # {message}: the job is ending; every pending op fails
TIMING = "timing"  # {on, why}: whether the rank's GPU timer may start (--swap auto gates it per device)
VERDICT = "verdict"  # {report}: answer to DEVICE_OOM, once the launcher has the report
SWAP = "swap"  # {op: size | out | in, offset, nbytes}: move the blocked rank's GPU state (runtime.vmm) to or
#   from the job's host region (runtime.swap_space); answered by SWAPPED
ROOM_MADE = "room_made"  # {ok, why}: blocked ranks were swapped out for a ROOM (ok: retry the allocation)

# launcher <-> coordinator
CONTROL = "control"  # {trace_dir, job}: hello of the launcher's control connection
EXITED = "exited"  # {rank, code}: the launcher saw a rank's process end
FINISH = "finish"  # {status, exit_codes, job, trace_dir, incomplete}: write the trace (incomplete: why) and stop
FATAL = "fatal"  # {kind, report}: coordinator found a hang, a stall or a mismatch
WRITTEN = "written"  # {path, error, note}: trace written (path), or why not (error); note: what to tell the user
PROGRESS = "progress"  # {connected, finished}

INLINE_LIMIT = 64 * 1024  # payloads up to this size travel inside the control message

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def no_delay(conn) -> None:
    """Turn off Nagle's algorithm on a connection's TCP socket.

    Without it, a second small message sent before the peer acknowledged the first (an op right
    after a marker, a grant right after a result) waits for the peer's delayed ACK: ~40 ms each.
    """
    import socket

    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


def dtype_name(dtype: torch.dtype) -> str:
    """Stable text name of a dtype, e.g. 'float32'."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} in a prism message") from None
