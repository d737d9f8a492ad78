"""The coordinator's side of the data plane: op inputs read from the ranks' shared-memory segments
(or the message), results written back there (or returned inline). Payload descriptors: protocol.py."""

from __future__ import annotations

import torch

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.matching import Member, desc_bytes
from prism_megatron.runtime.shm import SegmentGone, SegmentMap

_EMPTY = torch.empty(0, dtype=torch.uint8)


class DataPlane:
    def __init__(self) -> None:
        self.segments = SegmentMap()

    def arrived(self, rank: int, msg: dict) -> str | None:
        """An op's message: forget the segments the rank unlinked since its last op, and map every segment
        this one names now (a member's input is read only when the last member arrives, maybe long after).
        Returns why the op cannot be served: a segment it names is gone (shm.SegmentGone)."""
        for seg in msg.get("drops", ()):
            self.segments.drop(seg)
        try:
            for key in ("ins", "outs", "cur"):
                for d in msg.get(key, ()):
                    if d[0][0] == "s":
                        self.segments.attach(d[0][1])
        except SegmentGone as e:
            return f"rank {rank}: {msg['kind']} (op {msg['id']}): {e}"
        return None

    def read(self, desc: tuple, dtype: str) -> torch.Tensor:
        """An input as a flat tensor of ``dtype`` (a view of shared memory where it lies there)."""
        if desc[0] == "i":
            raw = torch.frombuffer(bytearray(desc[1]), dtype=torch.uint8) if desc[1] else _EMPTY
        else:
            raw = self.segments.view(desc[1], desc[2], desc[3])
        return raw.view(P.dtype_from_name(dtype)) if raw.numel() else torch.empty(0, dtype=P.dtype_from_name(dtype))

    def inputs(self, m: Member) -> list[torch.Tensor]:
        return [self.read(d[0], d[1]) for d in m.msg["ins"]]

    def out_view(self, m: Member, j: int, like: torch.Tensor) -> torch.Tensor | None:
        """Member ``m``'s output ``j`` in shared memory, typed like ``like``, or None when it is inline,
        empty, or of another size or type."""
        desc, dt, _ = m.msg["outs"][j]
        if desc[0] != "s" or not like.numel() or P.dtype_from_name(dt) != like.dtype or desc[3] != like.nbytes:
            return None
        return self.segments.view(desc[1], desc[2], desc[3]).view(like.dtype)

    def write(self, m: Member, outs: list[torch.Tensor | None]) -> list[bytes | None]:
        """Write `outs` (flat tensors, one per output of m) to shared memory; returns what the reply
        carries inline per output (None: in shared memory, or written by the rank itself)."""
        inline: list[bytes | None] = []
        for (desc, _dt, _shape), t in zip(m.msg["outs"], outs, strict=True):
            if desc[0] == "l":  # the rank wrote it (a group of one)
                inline.append(None)
                continue
            raw = t.reshape(-1).view(torch.uint8) if t is not None and t.numel() else None
            want = desc_bytes(desc)
            got = 0 if raw is None else raw.numel()
            if got != want:
                raise RuntimeError(f"internal: rank {m.rank} {m.kind} output of {got} bytes, expected {want}")
            if desc[0] == "s":
                if raw is not None:
                    dst = self.segments.view(desc[1], desc[2], desc[3])
                    if dst.data_ptr() != raw.data_ptr():  # not already written there (out_view)
                        dst.copy_(raw)
                inline.append(None)
            else:
                inline.append(raw.numpy().tobytes() if raw is not None else b"")
        return inline

    def drop(self, segment: str) -> None:
        """A rank unlinked ``segment``: forget its mapping."""
        self.segments.drop(segment)

    def close(self) -> None:
        self.segments.close()
