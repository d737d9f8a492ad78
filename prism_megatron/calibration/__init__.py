"""Calibration: slices, inter-slice alignment, the calibrated graph file, cluster profiles and the
collective cost model (with its fit from nccl-tests output).

What this package exports works from files only: it imports neither the runtime nor Megatron. The
slice run mode is imported by path: ``slice_run`` drives the launcher, and ``virtual_rank`` runs
inside a logical rank, where it uses torch.distributed and the runtime's ``idle``.
"""

from .align import AlignError, SliceRun, align_slices, slice_run_from_trace, spans_nodes
from .calibrated import (
    CalibratedFormatError,
    CalibratedGraph,
    OpCost,
    SliceProvenance,
    read_calibrated,
    write_calibrated,
)
from .costmodel import CollectiveCostModel, link_for
from .nccl_tests import NcclFit, fit_main, fit_profile_from_nccl_tests
from .profiles import ClusterProfile, Figure, ProfileError, load_profile, parse_profile, profile_names
from .slices import GroupTraffic, Slice, SliceError, group_traffic, plan_slices

__all__ = [
    "AlignError",
    "CalibratedFormatError",
    "CalibratedGraph",
    "ClusterProfile",
    "CollectiveCostModel",
    "Figure",
    "GroupTraffic",
    "NcclFit",
    "OpCost",
    "ProfileError",
    "Slice",
    "SliceError",
    "SliceProvenance",
    "SliceRun",
    "align_slices",
    "fit_main",
    "fit_profile_from_nccl_tests",
    "group_traffic",
    "link_for",
    "load_profile",
    "parse_profile",
    "plan_slices",
    "profile_names",
    "read_calibrated",
    "slice_run_from_trace",
    "spans_nodes",
    "write_calibrated",
]
