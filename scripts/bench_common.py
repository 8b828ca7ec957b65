"""Shared pieces of the decode-speed benchmark (``scripts/benchmark.py``).

* :class:`BenchConfig`: ``configs/bench/*.yaml`` loaded into a frozen dataclass;
* :func:`first_layers_draft`: a training-free draft (the target's first N layers with its
  embedding, final norm and head);
* model / draft / prompt loading for ``--model default|tiny|<preset>|<file.gguf>`` and
  ``--draft default|lookup|layers:N|<path>``;
* statistics: median and spread, the analytic speedup predictions, the two-sample
  chi-square test used as the benchmark's exactness check;
* the machine description and the marker-delimited section of ``BENCHMARKS.md``.

``scripts/`` is not a package: ``sys.path.insert(0, "scripts")`` then ``import bench_common``.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CONFIG_DIR = REPO / "configs" / "bench"
BEGIN_MARK = "<!-- benchmark:begin -->"
END_MARK = "<!-- benchmark:end -->"
METHODS = ("token", "block")


# --------------------------------------------------------------------------------------
# configuration


def _tuple(x, typ):
    if x is None:
        return None
    if isinstance(x, (str, int, float)):
        x = [x]
    return tuple(typ(v) for v in x)


def _per_batch(x) -> tuple:
    """``{1: [..], 4: [..]}`` (YAML mapping) -> sorted tuple of ``(batch, value)`` pairs."""
    if x is None:
        return ()
    if isinstance(x, dict):
        x = x.items()
    out = []
    for b, v in x:
        out.append((int(b), tuple(int(k) for k in v) if isinstance(v, (list, tuple)) else int(v)))
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Every field can be set in YAML; the CLI overrides a few."""

    name: str = "default"
    # models
    model: str = "default"  # default (SmolLM2-135M GGUF) | tiny (random) | preset name | .gguf path
    draft: str = "default"  # default (specjax.drafts.default_draft_for) | lookup | layers:N | path
    param_dtype: str = "float32"
    dtype: Optional[str] = None  # compute dtype; None = param_dtype
    scan_layers: bool = False  # lax.scan over layers: much faster compiles, slower CPU decode
    # workload
    prompts_file: str = "configs/bench/prompts.txt"
    num_prompts: int = 16
    chat_template: bool = True
    max_new_tokens: int = 64
    temperatures: tuple = (0.0, 0.7, 1.0)
    methods: tuple = METHODS
    batch_sizes: tuple = (1, 4, 16)
    ks: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    ks_by_batch: tuple = ()  # ((batch, (k, ...)), ...): K grid per batch size (default: ks)
    rows_by_batch: tuple = ()  # ((batch, rows), ...): prompts per timed repetition (default: num_prompts)
    # timing
    repeats: int = 3
    seed: int = 0
    step_repeats: int = 15  # timed calls of one jitted model step (cost ratios c and v)
    # exactness check (two-sample chi-square at this temperature)
    chi_square_temperature: float = 1.0
    chi_square_min_expected: float = 5.0
    # the Hugging Face peer (batch 1, same prompts and lengths)
    peer: bool = True
    peer_dtypes: tuple = ("float32", "bfloat16")
    peer_ks: tuple = (2, 4, 8)
    peer_schedules: tuple = ("constant", "heuristic")
    peer_temperatures: tuple = (0.0, 1.0)
    peer_repeats: int = 2
    peer_num_prompts: int = 0  # 0 = the batch-1 prompt set
    peer_threads: int = 0  # torch threads; 0 = os.cpu_count()
    # outputs
    out_dir: str = "out/bench"
    markdown: Optional[str] = None  # path of the BENCHMARKS.md whose marked section is rewritten
    publish_dir: Optional[str] = None  # copy the plots here (e.g. docs/bench) and link them
    plots: bool = True

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for k, typ in (("temperatures", float), ("methods", str), ("batch_sizes", int), ("ks", int),
                       ("peer_dtypes", str), ("peer_ks", int), ("peer_schedules", str),
                       ("peer_temperatures", float)):
            set_(k, _tuple(getattr(self, k), typ) or ())
        set_("ks_by_batch", _per_batch(self.ks_by_batch))
        set_("rows_by_batch", _per_batch(self.rows_by_batch))
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"methods must be among {METHODS}, got {bad}")
        if any(k < 1 for k in self.ks) or any(b < 1 for b in self.batch_sizes):
            raise ValueError("K and batch sizes must be >= 1")
        if any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be >= 0")
        if self.repeats < 1 or self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError("repeats, max_new_tokens and num_prompts must be >= 1")
        if self.peer_schedules and any(s not in ("constant", "heuristic") for s in self.peer_schedules):
            raise ValueError("peer_schedules must be among constant, heuristic")
        for b in self.batch_sizes:
            r = self.rows_for(b)
            if r % b:
                raise ValueError(f"rows_by_batch[{b}] = {r} is not a multiple of the batch size")

    # -- derived --------------------------------------------------------------------------
    def ks_for(self, batch: int) -> tuple:
        return dict(self.ks_by_batch).get(batch, self.ks)

    def rows_for(self, batch: int) -> int:
        r = dict(self.rows_by_batch).get(batch)
        if r is None:
            r = max(batch, (self.num_prompts // batch) * batch)
        return int(r)

    @property
    def compute_dtype(self) -> str:
        return self.dtype or self.param_dtype

    def replace(self, **changes) -> "BenchConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ks_by_batch"] = {b: list(v) for b, v in self.ks_by_batch}
        d["rows_by_batch"] = {b: v for b, v in self.rows_by_batch}
        return d


def load_config(name_or_path: str, **overrides) -> BenchConfig:
    """``configs/bench/<name>.yaml`` (or a YAML path) -> :class:`BenchConfig`; ``overrides``
    (None values ignored) replace fields."""
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") or p.exists()):
        p = CONFIG_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        avail = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"benchmark config {name_or_path!r} not found (available: {avail})")
    with open(p) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: expected a mapping")
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{p}: unknown benchmark config keys {sorted(unknown)}")
    raw.setdefault("name", p.stem)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return BenchConfig(**raw)


# --------------------------------------------------------------------------------------
# models, drafts, prompts


from specjax.drafts import first_layers_draft  # noqa: E402  (re-exported for the benchmark)


TINY = dict(vocab_size=64, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def load_target(spec: str, param_dtype: str = "float32", dtype: Optional[str] = None,
                scan_layers: bool = False):
    """``(model, tokenizer or None, description dict)`` for ``--model``."""
    dt = dict(param_dtype=param_dtype, dtype=dtype or param_dtype, scan_layers=bool(scan_layers))
    if spec == "tiny":
        from specjax.models import LlamaLM, tiny_config

        m = LlamaLM.init(tiny_config(**TINY, **dt, name="tiny-random"), seed=0)
        return m, None, {"kind": "tiny", "name": "tiny-random", **TINY, **dt}
    if spec in ("default", "smollm2", "smollm2-135m") or spec.endswith(".gguf"):
        from specjax import models
        path = None if not spec.endswith(".gguf") else spec
        m, meta = specjax.models.load_default_target(path, **dt)
        tok = specjax.models.load_default_tokenizer(path)
        return m, tok, {"kind": "gguf", "name": m.config.name, "path": meta.get("path"),
                        "n_layers": m.config.n_layers, "vocab_size": m.vocab_size,
                        "params": m.config.num_params(), **dt}
    from specjax.models.config import load_preset

    pre = load_preset(spec, **dt)
    m = pre.build(seed=0)
    return m, None, {"kind": "preset", "name": pre.name, "checkpoint": str(pre.checkpoint), **dt}


def resolve_draft(spec: str, target):
    """``--draft`` -> ``(draft for engine.make_proposer, description dict)``.

    ``default``: ``specjax.drafts.default_draft_for(target)``; ``lookup``: prompt lookup;
    ``layers:N``: :func:`first_layers_draft`; a path: a GGUF file, a model preset YAML, an HF
    checkpoint directory, or a draft saved by ``scripts/train_draft.py`` (``.npz``: an EAGLE
    head or a small model), all with the target's vocabulary."""
    if spec == "default":
        from specjax.drafts import default_draft_for

        d = default_draft_for(target)
        if isinstance(d, str):
            return resolve_draft(d if d != "ngram" else "lookup", target)[0], {"kind": "lookup", "spec": "default"}
        from specjax.models.eagle import EagleModel
        from specjax.drafts import shipped_draft_path

        if isinstance(d, EagleModel):
            return d, {"kind": "eagle", "spec": "default", "path": shipped_draft_path(target),
                       "n_layers": d.config.n_layers, "vocab_subset": d.config.vocab_subset}
        return d, {"kind": "model", "spec": "default", "name": getattr(getattr(d, "config", None), "name", "?")}
    if spec in ("lookup", "ngram", "prompt-lookup"):
        return "lookup", {"kind": "lookup", "spec": "lookup"}
    m = re.fullmatch(r"layers:(\d+)", spec)
    if m:
        n = int(m.group(1))
        return first_layers_draft(target, n), {"kind": "layers", "spec": spec, "n_layers": n}
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"--draft {spec!r}: expected default, lookup, layers:N or an existing path")
    runtime = dict(param_dtype=target.config.param_dtype, dtype=target.config.dtype,
                   scan_layers=target.config.scan_layers)
    if p.suffix == ".npz":
        from specjax.models.eagle import EagleModel
        from specjax.eagle import load_draft_model

        d = load_draft_model(str(p), target)
        if isinstance(d, EagleModel):
            return d, {"kind": "eagle", "spec": spec, "path": str(p.resolve()),
                       "n_layers": d.config.n_layers, "vocab_subset": d.config.vocab_subset}
    elif p.suffix == ".gguf":
        from specjax.models.gguf_loader import load_gguf

        d, _ = load_gguf(str(p), **runtime)
    elif p.suffix in (".yaml", ".yml"):
        from specjax.models.config import load_preset

        d = load_preset(str(p), **runtime).build(seed=0)
    else:
        from specjax.models.hf_checkpoint import load_hf

        d = load_hf(str(p), **runtime)
    if d.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary {d.vocab_size} != target vocabulary {target.vocab_size}")
    return d, {"kind": "model", "spec": spec, "path": str(p.resolve()), "n_layers": d.config.n_layers}


def read_prompts(path: str) -> list:
    p = Path(path)
    if not p.is_absolute():
        p = REPO / p
    lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def build_prompts(cfg: BenchConfig, tokenizer, vocab_size: int) -> tuple:
    """``(texts, token id lists)``: ``num_prompts`` prompts (cycled if the file has fewer).

    Without a tokenizer (``--model tiny``) the prompts are fixed pseudo-random token ids
    (lengths 6..20) with some repeated n-grams so prompt lookup has something to find."""
    if tokenizer is None:
        rng = np.random.default_rng(1234)
        texts, ids = [], []
        for i in range(cfg.num_prompts):
            n = int(rng.integers(6, 21))
            base = rng.integers(0, vocab_size, size=max(3, n // 2)).tolist()
            row = (base * 3)[:n]
            texts.append(f"<random ids #{i}>")
            ids.append([int(t) for t in row])
        return texts, ids
    texts = read_prompts(cfg.prompts_file)
    if not texts:
        raise ValueError(f"{cfg.prompts_file}: no prompts")
    texts = [texts[i % len(texts)] for i in range(cfg.num_prompts)]
    if cfg.chat_template:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for t in texts]
    else:
        ids = [tokenizer.encode(t) for t in texts]
    return texts, ids


# --------------------------------------------------------------------------------------
# statistics


def summarize(values: Sequence[float]) -> dict:
    """Median with spread: min, max, IQR (linear quantiles) and n."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "q1": float(np.quantile(v, 0.25)), "q3": float(np.quantile(v, 0.75)), "n": int(v.size)}


def expected_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha): expected tokens per round with i.i.d. acceptance."""
    if alpha is None or not math.isfinite(alpha):
        return float("nan")
    if abs(1.0 - alpha) < 1e-9:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, verify_ratio: float = 1.0) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(cK + v)); v = 1 is the textbook formula (Leviathan
    et al.), v = t_target(K+1 tokens) / t_target(1 token) adds the verification cost."""
    return expected_tokens(alpha, k) / (c * k + verify_ratio)


def _merge_bins(a_counts: dict, b_counts: dict, min_expected: float):
    """Token -> bin index: tokens with an expected count >= ``min_expected`` in both samples
    get their own bin, the rest share one "rare" bin (folded into the last bin when it is
    itself too small). Returns ``(mapping, n_bins)``; unknown tokens map to the rare bin."""
    keys = sorted(set(a_counts) | set(b_counts))
    na, nb = sum(a_counts.values()), sum(b_counts.values())
    n = na + nb
    mapping, n_bins, rare_tokens, rare = {}, 0, [], [0, 0]
    for t in keys:
        a, b = a_counts.get(t, 0), b_counts.get(t, 0)
        if min((a + b) * na / n, (a + b) * nb / n) >= min_expected:
            mapping[t] = n_bins
            n_bins += 1
        else:
            rare_tokens.append(t)
            rare[0] += a
            rare[1] += b
    tot = sum(rare)
    if tot and min(tot * na / n, tot * nb / n) >= min_expected:
        rare_bin = n_bins
        n_bins += 1
    else:
        rare_bin = max(n_bins - 1, 0)
    for t in rare_tokens:
        mapping[t] = rare_bin
    return mapping, max(n_bins, 1), rare_bin


def _chi2_stat(obs: np.ndarray) -> np.ndarray:
    """Pearson chi-square of [..., bins, 2] contingency tables."""
    col = obs.sum(axis=-2, keepdims=True)
    row = obs.sum(axis=-1, keepdims=True)
    exp = row * col / obs.sum(axis=(-2, -1), keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(exp > 0, (obs - exp) ** 2 / exp, 0.0)
    return terms.sum(axis=(-2, -1))


def chi_square_two_sample(a_counts: dict, b_counts: dict, min_expected: float = 5.0) -> dict:
    """Two-sample chi-square homogeneity test on token histograms ``{token: count}``
    (rare tokens merged, see :func:`_merge_bins`): statistic, degrees of freedom and the
    nominal p-value (``None`` with a reason when untestable).

    The nominal p-value assumes independent tokens; tokens of one sequence are not, so it
    is too small (see :func:`sequence_permutation_test` for a valid p-value)."""
    na, nb = sum(a_counts.values()), sum(b_counts.values())
    out = {"n_a": int(na), "n_b": int(nb), "distinct_tokens": len(set(a_counts) | set(b_counts))}
    if na == 0 or nb == 0:
        return {**out, "chi2": None, "dof": 0, "p_value": None, "bins": 0, "reason": "empty sample"}
    mapping, n_bins, _ = _merge_bins(a_counts, b_counts, min_expected)
    if n_bins < 2:
        return {**out, "chi2": None, "dof": 0, "p_value": None, "bins": n_bins,
                "reason": "fewer than 2 bins with enough expected counts"}
    obs = np.zeros((n_bins, 2))
    for t, c in a_counts.items():
        obs[mapping[t], 0] += c
    for t, c in b_counts.items():
        obs[mapping[t], 1] += c
    chi2 = float(_chi2_stat(obs))
    dof = n_bins - 1
    return {**out, "chi2": chi2, "dof": dof, "p_value": chi2_sf(chi2, dof), "bins": n_bins}


def sequence_permutation_test(seqs_a: Sequence, seqs_b: Sequence, min_expected: float = 5.0,
                              n_perm: int = 2000, seed: int = 0) -> dict:
    """The same chi-square statistic with a valid p-value: sequences (not tokens) are the
    exchangeable units. ``seqs_*`` are ``(stratum, tokens)`` pairs (stratum = the prompt);
    group labels are permuted among the sequences of each stratum, which is exact under
    the null that every sequence of a prompt is an independent draw from one law —
    provided no two sequences share random keys (the benchmark gives every speculative
    setting and repeat its own seed)."""
    import collections

    ca = collections.Counter(t for _, s in seqs_a for t in s)
    cb = collections.Counter(t for _, s in seqs_b for t in s)
    nominal = chi_square_two_sample(ca, cb, min_expected)
    if nominal["chi2"] is None:
        return {**nominal, "p_value_permutation": None, "n_perm": 0}
    mapping, n_bins, rare_bin = _merge_bins(ca, cb, min_expected)
    seqs = list(seqs_a) + list(seqs_b)
    h = np.zeros((len(seqs), n_bins))
    for i, (_, s) in enumerate(seqs):
        for t in s:
            h[i, mapping.get(t, rare_bin)] += 1
    label = np.array([1.0] * len(seqs_a) + [0.0] * len(seqs_b))
    strata = collections.defaultdict(list)
    for i, (st, _) in enumerate(seqs):
        strata[st].append(i)
    rng = np.random.default_rng(seed)
    perms = np.empty((n_perm, len(seqs)))
    for p in range(n_perm):
        lab = label.copy()
        for idx in strata.values():
            lab[idx] = rng.permutation(label[idx])
        perms[p] = lab
    total = h.sum(axis=0)
    a = perms @ h  # [n_perm, bins]
    stats = _chi2_stat(np.stack([a, total[None, :] - a], axis=-1))
    obs_a = label @ h
    obs = float(_chi2_stat(np.stack([obs_a, total - obs_a], axis=-1)))
    p = (1 + int(np.sum(stats >= obs - 1e-9))) / (1 + n_perm)
    return {**nominal, "p_value_permutation": p, "n_perm": n_perm,
            "n_seq_a": len(seqs_a), "n_seq_b": len(seqs_b)}


def chi2_sf(x: float, dof: int) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.sf(x, dof))
    except ImportError:  # Wilson-Hilferty
        z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


# --------------------------------------------------------------------------------------
# machine description


def _version(pkg: str) -> Optional[str]:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict:
    import jax

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    devs = jax.devices()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        commit = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "memory_gb": None if mem_gb is None else round(mem_gb, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devs],
        "device_kind": devs[0].device_kind if devs else None,
        "git_commit": commit,
        "loadavg_start": loadavg(),
    }


# --------------------------------------------------------------------------------------
# BENCHMARKS.md


def replace_marked_section(path: str, body: str, title: str = "# specjax benchmarks") -> None:
    """Rewrite the text between the benchmark markers of ``path`` (created if missing, the
    markers appended if absent); everything outside the markers is kept."""
    p = Path(path)
    block = f"{BEGIN_MARK}\n{body.rstrip()}\n{END_MARK}"
    if p.exists():
        text = p.read_text(encoding="utf-8")
        i, j = text.find(BEGIN_MARK), text.find(END_MARK)
        if i >= 0 and j > i:
            text = text[:i] + block + text[j + len(END_MARK):]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = f"{title}\n\n{block}\n"
    p.write_text(text, encoding="utf-8")
