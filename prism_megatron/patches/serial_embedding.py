"""Seam: ``LanguageModule.setup_embeddings_and_output_layer`` - tied word embeddings in a serial capture.

Megatron gives the last pipeline stage its own copy of the word embeddings for the output layer: the
copy is zeroed and all-reduced with the first stage's over the embedding group, so every copy starts
from the first stage's values (the members without the embedding contribute zeros). In a serial
capture (``launcher.serial``) the group's other end lives in another capture and self mirror
(``nccl_prune.SELF_MIRROR_RULE``) answers it with this rank's own values: the first stage would start
from n times its embeddings (n members), the last stage from zeros - an output layer of zeros passes
no gradient to any layer of its stage (its grad norm is 0 in the first iteration), a silent zero that
steers the program. ``RULE`` instead: the all-reduce still runs (its op and sequence number are the
capture together's); a member holding the embedding keeps its own initial values (what the sum gives
when the others add zeros: the result divided by n), and a member that zeroed its copy draws it again
from Megatron's initial distribution (normal, std ``init_method_std``) with a fixed seed: a stand-in of
the initial output layer, since the first stage's values are in another capture. Installed only in a
serial capture's ranks (``launcher.serial.CAPTURE_ENV``). Checked against the supported releases.
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()
#: the stand-in output layer's generator seed (fixed: every capture of a job draws the same values)
SEED = 20261202

RULE = """\
In a serial capture, Megatron's initial all-reduce of the tied word embeddings over the embedding group
(the last stage's zeroed copy summed with the first stage's) runs as captured together, then the
first stage keeps its own embeddings (the self-mirrored sum divided by the group's size) and a stage
whose copy Megatron zeroed gets a seeded draw from the initial distribution (normal, std
init_method_std): never zeros; the first stage's values are in another capture."""


def _shared(module: Any) -> Any:
    """The module's copy of the tied weight, or None (untied, or neither end of the pipeline)."""
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return None
    if not (getattr(module, "pre_process", False) or getattr(module, "post_process", False)
            or getattr(module, "mtp_process", False)):
        return None
    return module.shared_embedding_or_output_weight()


@once
def install() -> None:
    from megatron.core.models.common.language_module import language_module as lm

    cls = seam(lm, "LanguageModule", CHECKED)
    original = seam(cls, "setup_embeddings_and_output_layer", CHECKED)
    seam(cls, "_is_in_embd_group", CHECKED)

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        import torch

        original(self)
        weight = _shared(self)
        group = getattr(self, "embd_group", None)
        if (weight is None or group is None or not self._is_in_embd_group()
                or getattr(self.config, "init_model_with_meta_device", False)):  # Megatron skips the all-reduce
            return
        n = torch.distributed.get_world_size(group=group)
        if n < 2:
            return
        with torch.no_grad():
            if not getattr(self, "pre_process", False):  # Megatron zeroed this copy (no embedding layer here)
                gen = torch.Generator(device=weight.device).manual_seed(SEED)
                weight.data.normal_(0.0, float(self.config.init_method_std), generator=gen)
            else:  # the embedding's owner: n copies of its own values were summed
                weight.data.div_(n)

    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
