"""The decode-speed benchmark (``scripts/benchmark.py``), one module per job.

* :mod:`.config`: :class:`~.config.BenchConfig` (``configs/bench/*.yaml``, read by
  ``specjax.configs``) and the prompt set;
* :mod:`.timing`: the step-cost timer (c, v_K), the runner of timed passes, the whole
  grid of settings (:func:`~.timing.run_specjax`) and the exactness check;
* :mod:`.stats`: median and spread, the analytic speedup predictions;
* :mod:`.dataset`: the dataset workload (stop tokens on; fixed batches vs continuous
  batching), also used by ``scripts/bench_schedule.py``;
* :mod:`.peer`: the Hugging Face peer at batch 1 (``scripts/hf_peer.py``);
* :mod:`.plots`: the PNG plots (matplotlib, optional);
* :mod:`.report`: the machine description, the log line, the markdown section and the
  marker-delimited section of ``BENCHMARKS.md``.

Models, drafts and engines come from ``specjax.build`` / ``specjax.drafts`` /
``specjax.engine``, the chi-square tests from ``specjax.audit``. Import as
``scripts.bench.<module>`` with the checkout's root on ``sys.path``.
"""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout (relative paths of configs resolve here)
