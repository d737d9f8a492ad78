"""Calibration: cluster profiles, the collective cost model and its fit from nccl-tests output.

Works from files only: imports neither the runtime nor Megatron.
"""

from .costmodel import CollectiveCostModel, link_for
from .nccl_tests import NcclFit, fit_main, fit_profile_from_nccl_tests
from .profiles import ClusterProfile, Figure, ProfileError, load_profile, parse_profile, profile_names

__all__ = [
    "ClusterProfile",
    "CollectiveCostModel",
    "Figure",
    "NcclFit",
    "ProfileError",
    "fit_main",
    "fit_profile_from_nccl_tests",
    "link_for",
    "load_profile",
    "parse_profile",
    "profile_names",
]
