"""Progress lines: start-up, then capture with an estimate of the time left."""

from prism_megatron.launcher.progress import Progress
from prism_megatron.megatron.run import _flag_int


def test_progress_estimates_from_the_rate_so_far():
    t = [0.0]
    p = Progress(8, 10, clock=lambda: t[0])
    t[0] = 2.0
    p.update(4, 0, 0)
    assert p.line() == "starting ranks: 4/8 connected, 2 s, ~2 s left to start"
    t[0] = 4.0
    p.update(8, 0, 0)  # capture starts when every rank is connected
    assert "iterations 0/80" in p.line() and "left" not in p.line()
    t[0] = 14.0
    p.update(8, 1, 20)  # 20 of 80 in 10 s of capture -> 30 s left
    assert p.line() == "capture: 1/8 ranks finished, iterations 20/80 over all ranks (25%), 14 s elapsed, ~30 s left"
    t[0] = 4000.0
    assert "~3 h 19 min left" in p.line()


def test_progress_without_known_iterations_counts_them():
    t = [0.0]
    p = Progress(2, None, clock=lambda: t[0])
    t[0] = 5.0
    p.update(2, 0, 3)
    assert p.line() == "capture: 0/2 ranks finished, 3 rank-iterations done, 5 s elapsed"


def test_train_iters_from_a_megatron_command_line():
    assert _flag_int(["--train-iters", "7", "--lr", "1"], "--train-iters") == 7
    assert _flag_int(["--train-iters=3", "--train-iters", "9"], "--train-iters") == 9  # the parser keeps the last
    assert _flag_int(["--lr", "1"], "--train-iters") is None
