"""Scheduling units of the combined-1F1B schedules (a forward and another microbatch's backward in one step).

Megatron runs them only with CUDA streams and MoE A2A overlap, which CPU mode cannot; so the wrapper is
driven here with a stand-in of ``combined_forward_backward_step`` in the order the no-pipelining
schedule calls it, and the real function is checked to have the parameters the wrapper reads.
"""

from __future__ import annotations

import pytest

from prism_megatron.patches import schedules
from prism_megatron.trace import markers

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)


class _Sink:
    def __init__(self) -> None:
        self.marks: list[tuple[str, str, dict]] = []

    def record_mark(self, name: str, phase: str, attrs: dict) -> None:
        self.marks.append((name, phase, attrs))


def _stand_in(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store,
              b_model, b_input_tensor, b_output_tensor, b_output_tensor_grad, config, f_model_chunk_id=None,
              pre_forward=None, pre_backward=None, post_forward=None, post_backward=None,
              collect_non_loss_data=False, checkpoint_activations_microbatch=None, is_first_microbatch=False,
              current_microbatch=None, encoder_decoder_xattn=False):
    return (object() if f_model is not None else None), 1, None


def test_the_real_function_has_the_parameters_the_wrapper_reads():
    real = pytest.importorskip("megatron.core.pipeline_parallel.combined_1f1b")
    from prism_megatron.patches import seam

    seam(real, "combined_forward_backward_step", schedules.CHECKED, schedules._COMBINED_PARAMS)


def test_combined_steps_become_units_pairing_each_backward_with_its_forward(monkeypatch):
    sink = _Sink()
    monkeypatch.setattr(markers, "_sink", None, raising=False)
    markers.set_sink(sink)
    monkeypatch.setattr(schedules, "STATE", schedules._State())
    schedules.STATE.begin_iteration(7)
    step = schedules.wrap_combined(_stand_in)
    model, n = object(), 3
    try:
        out, _, _ = step(None, None, model, n, None, [], None, None, None, None, None, current_microbatch=0)
        for i in range(n - 1):  # the steady phase: forward of i+1 with the backward of i
            out, _, _ = step(None, None, model, n, None, [], model, None, out, None, None, current_microbatch=i + 1)
        step(None, None, None, n, None, [], model, None, out, None, None)
    finally:
        markers.set_sink(None)
    begins = [(name, attrs) for name, phase, attrs in sink.marks if phase == "B"]
    assert begins == [
        ("forward", {"iteration": 7, "microbatch": 0, "chunk": 0}),
        ("forward_backward", {"iteration": 7, "microbatch": 1, "chunk": 0, "backward_microbatch": 0,
                              "backward_chunk": 0}),
        ("forward_backward", {"iteration": 7, "microbatch": 2, "chunk": 0, "backward_microbatch": 1,
                              "backward_chunk": 0}),
        ("backward", {"iteration": 7, "microbatch": 2, "chunk": 0}),
    ]
    assert [phase for _, phase, _ in sink.marks] == ["B", "E"] * 4
    assert schedules.STATE.pending == {}  # every forward met its backward
