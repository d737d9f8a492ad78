"""Replay speed at scale: replay of a folded job (the method replay picks) vs the full synthesised replay.

Builds a Megatron-shaped 1F1B graph (``prism_megatron.replay.synthetic``; TP·PP·DP in Megatron's
rank order; every stage on its own 1F1B schedule) and folds it: ``--depth replica`` to data-parallel
replica 0 (the v1 sandbox of a dense model), ``--depth class`` to one live rank per class (a version-2
fold: TP peers and the middle pipeline stages folded too; synthesis gives each folded stage its own
order of units, replay.stage_schedule, and the bench also prints the exact replica fold's figures,
which the class fold must equal). Prints the wall time of
(a) the replay of the folded graph (``replay`` picks an exact method: the live ranks symmetrically,
or one synthesised pipeline when stages are folded; it prints which) and (b) synthesising the full
graph of every rank and replaying it, with events per second and peak memory, and checks that both
predict the same iteration times. Issue 19's target: the 8,192-rank graph replays in under 60 s.

    python bench/replay_scale.py                      # TP2·PP4·DP1024: 8,192 ranks, replica fold
    python bench/replay_scale.py --depth class        # the same job, middle stages and TP peers folded
    python bench/replay_scale.py --depth class --pp 8 --dp 512
    python bench/replay_scale.py --dp 128             # 1,024 ranks
    python bench/replay_scale.py --no-full            # the folded replay only
    python bench/replay_scale.py --dp 128 --profile   # cProfile of the full replay (top 25)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

from prism_megatron.calibration.costmodel import CollectiveCostModel
from prism_megatron.calibration.profiles import load_profile
from prism_megatron.replay import replay
from prism_megatron.replay.synthesize import fold_graph, synthesize
from prism_megatron.replay.synthetic import Shape, class_fold, megatron_1f1b, replica_fold


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers-per-stage", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cluster", default="h100-nvlink-ib400")
    ap.add_argument("--depth", choices=("replica", "class"), default="replica",
                    help="fold to DP replica 0 (v1) or to one live rank per class (v2: TP peers, middle stages)")
    ap.add_argument("--no-full", action="store_true", help="skip the full synthesised replay")
    ap.add_argument("--profile", action="store_true", help="cProfile the full replay and print the top 25")
    args = ap.parse_args()

    shape = Shape(tp=args.tp, pp=args.pp, dp=args.dp, microbatches=args.microbatches,
                  layers_per_stage=args.layers_per_stage, iterations=args.iterations, gpu_times=True)
    cost = CollectiveCostModel(load_profile(args.cluster), gpus_per_node=args.gpus_per_node)
    print(f"job: TP{shape.tp}·PP{shape.pp}·DP{shape.dp} = {shape.world_size} ranks, {shape.microbatches} "
          f"microbatches x {shape.iterations} iterations, {shape.layers_per_stage} layers per stage, "
          f"cluster {args.cluster}, {args.gpus_per_node} GPUs per node; {args.depth} fold")

    t = time.perf_counter()
    full_graph = megatron_1f1b(shape)
    built = time.perf_counter() - t
    if args.depth == "class":
        folded = fold_graph(full_graph, gpus_per_node=args.gpus_per_node, **class_fold(shape))
    else:
        folded = fold_graph(full_graph, replica_fold(shape), args.gpus_per_node)
    n_live = sum(len(e) for e in folded.events.values())
    n_full = sum(len(e) for e in full_graph.events.values())
    print(f"built the full graph in {built:.1f} s: {n_full:,} events ({n_full // shape.world_size} per rank); "
          f"folded: {len(folded.events)} live ranks, {n_live:,} events")
    del full_graph

    t, c = time.perf_counter(), time.process_time()
    sym = replay(folded, cost)
    t_sym, c_sym = time.perf_counter() - t, time.process_time() - c
    print(f"(a) folded replay ({sym.method}): {t_sym:.3f} s wall, {c_sym:.3f} s CPU; iteration times "
          f"{', '.join(f'{x * 1e3:.3f}' for x in sym.iteration_times())} ms; peak RSS {_peak_gib():.2f} GiB")
    if args.depth == "class":  # the replica fold keeps every stage live: exact, and the class fold must equal it
        replica = fold_graph(megatron_1f1b(shape), replica_fold(shape), args.gpus_per_node)
        t = time.perf_counter()
        exact = replay(replica, cost)
        same = exact.iteration_times() == sym.iteration_times()
        print(f"    replica fold (every stage live, exact): {exact.method}, {time.perf_counter() - t:.3f} s wall; "
              f"iteration times {', '.join(f'{x * 1e3:.3f}' for x in exact.iteration_times())} ms; "
              f"class fold == replica fold: {same}")
    if args.no_full:
        return

    t, c = time.perf_counter(), time.process_time()  # on a shared machine CPU time is the steadier figure
    graph = synthesize(folded)
    t_syn, c_syn = time.perf_counter() - t, time.process_time() - c
    print(f"(b) synthesised the full graph: {t_syn:.1f} s wall, {c_syn:.1f} s CPU, {len(graph.events)} ranks")
    t, c = time.perf_counter(), time.process_time()
    if args.profile:
        prof = cProfile.Profile()
        full = prof.runcall(replay, graph, cost)
    else:
        full = replay(graph, cost)
    t_full, c_full = time.perf_counter() - t, time.process_time() - c
    print(f"(b) full replay: {t_full:.1f} s wall, {c_full:.1f} s CPU ({1e6 * c_full / n_full:.2f} us CPU per event); "
          f"synthesis + replay {t_syn + t_full:.1f} s wall, {c_syn + c_full:.1f} s CPU; peak RSS {_peak_gib():.2f} GiB")
    same = full.iteration_times() == sym.iteration_times() and all(
        full.rank_end[r] == sym.rank_end[r] and full.event_times[r] == sym.event_times[r] for r in sym.graph.events)
    print(f"folded replay == full: {same} (iteration times; replayed ranks' end and event times); "
          f"speed-up {(t_syn + t_full) / t_sym:.0f}x")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
