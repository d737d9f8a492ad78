"""Which cluster profile costs a replay's communication: the one asked for, else the run's own.

A trace records the profile its run costed communication with (``trace.costing``), so the report,
replay or comparison of a trace predicts what the run predicted unless told otherwise: ``--cluster
NAME|FILE`` picks another profile, ``--cluster none`` costs communication free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prism_megatron.trace import PrismTrace

#: The ``--cluster`` value that asks for communication free, whatever the trace recorded.
NO_PROFILE = "none"


@dataclass(frozen=True)
class Costing:
    """The profile that costs communication (None: free) and whether it is the one the trace recorded."""

    cluster: str | None
    recorded: bool = False

    def describe(self) -> str:
        """Provenance words: 'costed by cluster profile X (...)' or 'free (...)'."""
        if self.cluster is None:
            return "free (no cluster profile)"
        return f"costed by cluster profile {self.cluster}" + (" (the run's, recorded in the trace)"
                                                               if self.recorded else "")


def choose_costing(given: str | None, trace: PrismTrace) -> Costing:
    """``given`` (a profile, or ``NO_PROFILE``) if any, else the profile ``trace`` records (an older trace
    records none: free). A recorded profile file that no longer exists is refused, naming it and the
    override, rather than silently predicting with another."""
    from prism_megatron.calibration.profiles import names_file, profile_reference

    recorded = None if trace.cluster is None else trace.cluster.profile
    if given == NO_PROFILE:
        return Costing(None)
    if given is not None:  # the run's own profile (its report: the run passes it) says so like a remade one
        same = recorded is not None and profile_reference(given) == recorded
        return Costing(recorded if same else given, recorded=same)
    if recorded is None:
        return Costing(None, recorded=trace.cluster is not None)
    # a run records a profile file by its absolute path (profile_reference)
    if (names_file(recorded) or Path(recorded).is_absolute()) and not Path(recorded).is_file():
        raise ValueError(f"trace {trace.path}: the run costed communication with cluster profile {recorded!r} "
                         "(manifest field 'job.cluster'), which no longer exists: pass --cluster NAME|FILE to cost "
                         f"it with another profile, or --cluster {NO_PROFILE} for communication free")
    return Costing(recorded, recorded=True)

