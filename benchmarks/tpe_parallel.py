"""TPE with 4 trials running at once, as `vitlab tune --devices` on 4 GPUs runs them (4 asked; each time one ends, at
random, its successor asked), each trial's draw seeded by the study's seed and its number as vitlab's are: the best
value after 40 trials, with and without Optuna's constant_liar (which counts running trials as bad ones), over seeds.
The objective stands in for a recipe: a bowl over log learning rate, log weight decay, warm-up and depth.

    python benchmarks/tpe_parallel.py [SEEDS]
"""
import math, statistics, sys, warnings
import numpy as np
import optuna
optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.filterwarnings("ignore")

def f(p):  # minimum 0 at lr=3e-3, wd=0.05, warmup=0.3, depth=3
    return ((math.log10(p["lr"]) - math.log10(3e-3)) ** 2 * 4 + (math.log10(p["wd"]) + 1.3) ** 2
            + (p["warmup"] - 0.3) ** 2 + 0.1 * (p["depth"] - 3) ** 2)

dists = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True),
         "wd": optuna.distributions.FloatDistribution(1e-3, 0.3, log=True),
         "warmup": optuna.distributions.FloatDistribution(0.0, 1.0),
         "depth": optuna.distributions.IntDistribution(1, 8)}

def run(seed, liar, n=40, parallel=4):
    study = optuna.create_study()
    rng = np.random.default_rng(seed)
    running = []
    def ask(k):
        s = optuna.samplers.TPESampler(seed=int(np.random.SeedSequence([seed, k]).generate_state(1)[0]), constant_liar=liar)
        study.sampler = s
        return study.ask(dists)
    k = 0
    for _ in range(parallel):
        running.append(ask(k)); k += 1
    done = 0
    while done < n:
        t = running.pop(int(rng.integers(len(running))))  # one of the running trials ends
        study.tell(t, f(t.params)); done += 1
        if k < n:
            running.append(ask(k)); k += 1
    return study.best_value

seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
for liar in (False, True):
    vals = [run(s, liar) for s in seeds]
    print(f"constant_liar={liar}: median best {statistics.median(vals):.4f}, mean {statistics.mean(vals):.4f}")
