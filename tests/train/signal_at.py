"""Run `cem-train` in this process with a signal sent to this very process at one point of the
run, deterministically (not by timing):

    python tests/train/signal_at.py POINT SIGNAL[xN] [cem-train arguments]

The signal (SIGINT or SIGTERM; `xN`: N times in a row) is sent once the run reaches POINT:

    import      JAX is being imported (`cem_jax.cli.train.main` catches signals before that)
    documents   the first text document has been read (by the tokenizer's training when the
                run trains one, else by the tokenization of the training split)
    peak-flops  the peak-FLOPs probe starts (`cem_jax.train.metrics.measure_matmul_peak`)
    first-step  the first train step is called (its compilation)
    eval-K      the K-th validation of this process has evaluated its first batch

Then it exits with `cem_jax.cli.train.main`'s status.
"""

import importlib.abc
import os
import signal
import sys


def send(times: int, signum: int):
    """A function sending `signum` to this process `times` times, on its first call only."""
    sent = []

    def fire():
        if not sent:
            sent.append(True)
            for _ in range(times):
                os.kill(os.getpid(), signum)

    return fire


class _OnJaxImport(importlib.abc.MetaPathFinder):
    def __init__(self, fire):
        self.fire = fire

    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            self.fire()
        return None  # the import goes on as usual


def arm(point: str, fire) -> None:
    """Make the run call `fire` at `point` (see the module docstring)."""
    if point == "import":
        sys.meta_path.insert(0, _OnJaxImport(fire))
        return
    from cem_jax.data import sources
    from cem_jax.train import metrics, run, step

    if point == "documents":
        documents = sources.Source.documents

        def documents_then_fire(self, unit=None):
            for i, doc in enumerate(documents(self, unit)):
                yield doc
                if i == 0:
                    fire()

        sources.Source.documents = documents_then_fire
    elif point == "peak-flops":
        measure = metrics.measure_matmul_peak
        metrics.measure_matmul_peak = lambda *a, **k: (fire(), measure(*a, **k))[1]
    elif point == "first-step":
        init = step.Trainer.__init__

        def init_then_wrap(self, *args, **kwargs):
            init(self, *args, **kwargs)
            train_step = self.train_step
            self.train_step = lambda *a: (fire(), train_step(*a))[1]

        step.Trainer.__init__ = init_then_wrap
    elif point.startswith("eval-"):
        arm_validation(run, int(point.removeprefix("eval-")), fire)
    else:
        raise SystemExit(f"signal_at.py: unknown point {point!r}")


def arm_validation(run, k: int, fire) -> None:
    """`fire` after the first batch of the k-th call of cem-train's `evaluate`."""
    evaluate, calls = run.evaluate, []

    def evaluate_then_fire(*args, eval_step, **kwargs):
        calls.append(1)
        if len(calls) == k:
            step = eval_step
            eval_step = lambda *a: (step(*a), fire())[0]  # noqa: E731
        return evaluate(*args, eval_step=eval_step, **kwargs)

    run.evaluate = evaluate_then_fire


def main(argv: list[str]) -> int:
    point, sig, *args = argv
    name, _, times = sig.partition("x")
    arm(point, send(int(times or 1), getattr(signal, name)))
    from cem_jax.cli.train import main as cem_train

    return cem_train(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
