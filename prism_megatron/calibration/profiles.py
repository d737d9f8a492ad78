"""Cluster profiles: the target cluster's links as versioned YAML, every figure with its source.

A predicted iteration time is only as good as the link figures behind it, so each number carries
where it came from (``source``) and what kind of number it is (``basis``: ``spec`` for a vendor
data-sheet value, ``measured`` for a benchmark result, ``fitted`` for a fit from nccl-tests output,
``assumed`` for an engineering estimate). The reader rejects unknown keys and names the file and
the field in every error, like the trace and recipe readers.

Format (version 1)::

    version: 1
    name: h100-nvlink-ib400
    description: ...
    gpus_per_node: {value: 8, basis: spec, source: "..."}
    intra_node:                        # GPU <-> GPU inside a node (NVLink/NVSwitch)
      bandwidth_GBps: {value: ..., basis: ..., source: ...}   # per GPU, per direction
      latency_us: {...}                                        # per algorithm step
    inter_node:                        # node <-> node (InfiniBand/RoCE)
      nics_per_node: {...}
      nic_bandwidth_GBps: {...}                                # per NIC, per direction
      latency_us: {...}
    nccl:
      algorithm: auto                  # ring | tree | pat | nvls | auto (auto: what NCCL would pick)
      nvls: {value: 0, ...}            # optional: 1 when NVLink SHARP runs (NCCL_NVLS_ENABLE), default 0
      protocol: simple                 # simple | ll | ll128 | auto (auto: the fastest)
      protocols:                       # multipliers on latency and bandwidth, per protocol
        simple: {latency_factor: {...}, bandwidth_factor: {...}}
        ll: {...}
        ll128: {...}
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prism_megatron.recipes import ROOT as RECIPES_ROOT

VERSION = 1
PROFILES_DIR: Path = RECIPES_ROOT / "clusters"  # package data
BASES = ("spec", "measured", "fitted", "assumed")
ALGORITHMS = ("ring", "tree", "pat", "nvls", "auto")
PROTOCOLS = ("simple", "ll", "ll128")


class ProfileError(ValueError):
    """A cluster profile is malformed; the message is ``cluster profile <file>: <field> <problem>``."""

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.path, self.field, self.problem = str(path), field, problem
        super().__init__(f"cluster profile {self.path}: {field} {problem}")


@dataclass(frozen=True)
class Figure:
    """A number with its provenance."""

    value: float
    source: str
    basis: str


@dataclass(frozen=True)
class ProtocolFactors:
    """How an NCCL protocol scales the latency and the bandwidth of the Simple protocol."""

    latency_factor: Figure
    bandwidth_factor: Figure


@dataclass(frozen=True)
class ClusterProfile:
    """A target cluster's link classes and NCCL choices. Units: bytes, seconds (see accessors)."""

    name: str
    description: str
    gpus_per_node: Figure
    intra_bandwidth_GBps: Figure
    intra_latency_us: Figure
    nics_per_node: Figure
    nic_bandwidth_GBps: Figure
    inter_latency_us: Figure
    algorithm: str
    protocol: str
    protocols: dict[str, ProtocolFactors]
    path: str = "<string>"
    nvls_enabled: Figure | None = None  # optional; absent: NVLS off

    @property
    def nvls(self) -> bool:
        """Whether NCCL may run NVLS (NVLink SHARP) inside a node on this cluster."""
        return self.nvls_enabled is not None and self.nvls_enabled.value >= 1

    @property
    def node_size(self) -> int:
        return int(self.gpus_per_node.value)

    @property
    def intra_bw(self) -> float:
        """Intra-node bandwidth per GPU per direction, bytes/s."""
        return self.intra_bandwidth_GBps.value * 1e9

    @property
    def inter_bw_per_gpu(self) -> float:
        """Inter-node bandwidth one GPU gets when all GPUs of a node talk off-node: nics * bw / gpus."""
        return self.nics_per_node.value * self.nic_bandwidth_GBps.value * 1e9 / self.gpus_per_node.value

    @property
    def intra_alpha(self) -> float:
        return self.intra_latency_us.value * 1e-6

    @property
    def inter_alpha(self) -> float:
        return self.inter_latency_us.value * 1e-6


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (plain PyYAML silently keeps the last one)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ProfileError:
        return ProfileError(self.path, field, problem)

    def mapping(self, obj: Any, field: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(obj, dict):
            raise self.error(field or "top level", f"is {type(obj).__name__}, expected a mapping")
        for key in obj:
            if key not in required and key not in optional:
                allowed = ", ".join(required + optional)
                raise self.error(f"{field}.{key}" if field else str(key), f"is not a known key (expected: {allowed})")
        for key in required:
            if key not in obj:
                raise self.error(f"{field}.{key}" if field else key, "is missing")
        return obj

    def string(self, obj: dict, key: str, field: str, choices: tuple[str, ...] | None = None) -> str:
        value = obj[key]
        name = f"{field}.{key}" if field else key
        if not isinstance(value, str) or not value.strip():
            raise self.error(name, f"is {value!r}, expected a non-empty string")
        if choices is not None and value not in choices:
            raise self.error(name, f"is {value!r}, expected one of {', '.join(choices)}")
        return value

    def figure(self, obj: dict, key: str, field: str, *, integer: bool = False, upper: float | None = None) -> Figure:
        name = f"{field}.{key}" if field else key
        fig = self.mapping(obj[key], name, ("value", "source", "basis"))
        value = fig["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(f"{name}.value", f"is {value!r}, expected a positive number")
        if integer and (not isinstance(value, int)):
            raise self.error(f"{name}.value", f"is {value!r}, expected a positive integer")
        if upper is not None and value > upper:
            raise self.error(f"{name}.value", f"is {value!r}, expected at most {upper}")
        return Figure(value, self.string(fig, "source", name), self.string(fig, "basis", name, BASES))


def parse_profile(text: str, source: str = "<string>") -> ClusterProfile:
    """Parse and validate profile YAML ``text``; ``source`` names the file in errors."""
    r = _Reader(source)
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "YAML"
        raise ProfileError(source, where, f"is not valid YAML: {getattr(e, 'problem', None) or e}") from None
    top = r.mapping(doc, "", ("version", "name", "gpus_per_node", "intra_node", "inter_node", "nccl"),
                    ("description",))
    if top["version"] != VERSION or isinstance(top["version"], bool):
        raise r.error("version", f"is {top['version']!r}; this reader supports cluster profile version {VERSION}")
    intra = r.mapping(top["intra_node"], "intra_node", ("bandwidth_GBps", "latency_us"))
    inter = r.mapping(top["inter_node"], "inter_node", ("nics_per_node", "nic_bandwidth_GBps", "latency_us"))
    nccl = r.mapping(top["nccl"], "nccl", ("algorithm", "protocol", "protocols"), ("nvls",))
    protos = r.mapping(nccl["protocols"], "nccl.protocols", PROTOCOLS)
    factors = {}
    for p in PROTOCOLS:
        f = f"nccl.protocols.{p}"
        entry = r.mapping(protos[p], f, ("latency_factor", "bandwidth_factor"))
        factors[p] = ProtocolFactors(r.figure(entry, "latency_factor", f),
                                     r.figure(entry, "bandwidth_factor", f, upper=1.0))
    description = top.get("description", "")
    if not isinstance(description, str):
        raise r.error("description", f"is {type(description).__name__}, expected a string")
    return ClusterProfile(
        name=r.string(top, "name", ""),
        description=description,
        gpus_per_node=r.figure(top, "gpus_per_node", "", integer=True),
        intra_bandwidth_GBps=r.figure(intra, "bandwidth_GBps", "intra_node"),
        intra_latency_us=r.figure(intra, "latency_us", "intra_node"),
        nics_per_node=r.figure(inter, "nics_per_node", "inter_node", integer=True),
        nic_bandwidth_GBps=r.figure(inter, "nic_bandwidth_GBps", "inter_node"),
        inter_latency_us=r.figure(inter, "latency_us", "inter_node"),
        algorithm=r.string(nccl, "algorithm", "nccl", ALGORITHMS),
        protocol=r.string(nccl, "protocol", "nccl", (*PROTOCOLS, "auto")),
        protocols=factors,
        path=source,
        nvls_enabled=_nvls(r, nccl),
    )


def _nvls(r: _Reader, nccl: dict) -> Figure | None:
    """nccl.nvls: 0 or 1 with its source (a figure whose value is a switch)."""
    if "nvls" not in nccl:
        return None
    fig = r.mapping(nccl["nvls"], "nccl.nvls", ("value", "source", "basis"))
    if fig["value"] not in (0, 1) or isinstance(fig["value"], bool):
        raise r.error("nccl.nvls.value", f"is {fig['value']!r}, expected 0 or 1")
    return Figure(fig["value"], r.string(fig, "source", "nccl.nvls"), r.string(fig, "basis", "nccl.nvls", BASES))


def profile_names() -> list[str]:
    """Names of the shipped profiles (file stems under ``recipes/clusters``)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def names_file(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether ``name_or_path`` names a profile file rather than a shipped profile: a YAML suffix, or a
    file that exists (how ``load_profile`` tells them apart)."""
    path = Path(name_or_path)
    return path.suffix in (".yaml", ".yml") or path.is_file()


def profile_reference(name_or_path: str | os.PathLike[str]) -> str:
    """How a trace records the profile a run used: a shipped name as given, a file by its absolute
    path (a report made later, from another directory, reads the same file)."""
    return str(Path(name_or_path).resolve()) if names_file(name_or_path) else str(name_or_path)


def load_profile(name_or_path: str | os.PathLike[str]) -> ClusterProfile:
    """Load a shipped profile by name (``h100-nvlink-ib400``) or any profile file by path."""
    path = Path(name_or_path)
    if not names_file(name_or_path):
        path = PROFILES_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ProfileError(name_or_path, "(name)",
                               f"is not a shipped profile ({', '.join(profile_names()) or 'none'}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(path, "(file)", f"cannot be read: {e.strerror or e}") from None
    profile = parse_profile(text, str(path))
    return profile
