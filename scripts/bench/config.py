"""What a benchmark run measures: :class:`BenchConfig` (``configs/bench/*.yaml``) and the
prompt set it runs on."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from scripts.bench import REPO
from specjax.configs import load_config

# the verification methods a benchmark may time; "tree": the draft grows a tree
# (specjax.drafts.trees.make_tree_proposer) of depth K, tree_topk children per expanded
# node and tree_nodes nodes, verified in one tree-attention pass
METHODS = ("token", "block", "tree")
DATASET_PROMPTS = "configs/bench/dataset_prompts.txt"  # written apart from the training prompts, many styles


def _tuple(x, typ):
    if x is None:
        return None
    if isinstance(x, (str, int, float)):
        x = [x]
    return tuple(typ(v) for v in x)


def grid_k(x):
    """One K of the grid: an integer, or ``"auto"`` (the adaptive engine, ``k="auto"``)."""
    if isinstance(x, str) and x.strip().lower() == "auto":
        return "auto"
    try:
        if not isinstance(x, bool) and float(x) == int(float(x)):
            return int(float(x))
    except (TypeError, ValueError, OverflowError):
        pass
    raise ValueError(f"K must be an integer or 'auto', got {x!r}")


def k_order(k) -> tuple:
    """Sort key of grid Ks: the fixed Ks in order, then auto."""
    return (1, 0) if k == "auto" else (0, k)


def _as_tuple(v) -> tuple:
    return v if isinstance(v, tuple) else (v,)


def _per_batch(x) -> tuple:
    """``{1: [..], 4: [..]}`` (YAML mapping) -> sorted tuple of ``(batch, value)`` pairs
    (list values are grid Ks: integers or "auto")."""
    if x is None:
        return ()
    if isinstance(x, dict):
        x = x.items()
    out = []
    for b, v in x:
        out.append((int(b), tuple(grid_k(k) for k in v) if isinstance(v, (list, tuple)) else int(v)))
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Every field can be set in YAML; the CLI overrides a few."""

    name: str = "default"
    # models (specjax.build.load_target / resolve_draft specs)
    model: str = "default"  # default (SmolLM2-135M GGUF) | tiny (random) | preset name | .gguf path
    draft: str = "default"  # default (specjax.drafts.files.default_draft_for) | lookup | layers:N | path
    param_dtype: str = "float32"
    dtype: Optional[str] = None  # compute dtype; None = param_dtype
    # lax.scan over layers (much faster compiles; slower decode on CPU and GPU) or unrolled;
    # "auto": the backend's faster mode (unrolled on CPU/GPU, scanned on TPU)
    scan_layers: Any = "auto"
    # workload
    prompts_file: str = "configs/bench/prompts.txt"
    num_prompts: int = 16
    chat_template: bool = True
    max_new_tokens: int = 64
    temperatures: tuple = (0.0, 0.7, 1.0)
    methods: tuple = ("token", "block")
    # method "tree" (build.TreeSpec; K is the depth): greedy rounds grow the top-k tree of
    # tree_topk children per expanded node and tree_nodes nodes, sampled rounds draw a full
    # tree of tree_branching children per level (tree_candidates: how; point_mass: the
    # top-k tree in every round), or with tree_widths a tree of that many nodes per level
    # shaped as it grows (without replacement)
    tree_topk: int = 3
    tree_nodes: int = 6
    tree_branching: tuple = (2, 1, 1)
    tree_candidates: str = "without_replacement"
    tree_widths: tuple = ()
    tree_sampled_nodes: int = 0  # > 0: sampled rounds fill the positional tree of that many nodes
    batch_sizes: tuple = (1, 4, 16)
    # the K grid; "auto" times the adaptive engine (k="auto": 0..build.AUTO_MAX_K draft
    # tokens a round by the measured round costs), in its own group after the fixed Ks
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
    # the dataset workload (scripts/bench/dataset.py): None = off, else a mapping of
    # prompts_file, num_prompts and the fields of dataset.DatasetSpec (batch, max_new_tokens,
    # temperature, top_p, k, settings, modes, repeats); stop tokens on, natural lengths
    dataset: Optional[dict] = None
    # outputs
    out_dir: str = "out/bench"
    markdown: Optional[str] = None  # path of the BENCHMARKS.md whose marked section is rewritten
    publish_dir: Optional[str] = None  # copy the plots here (e.g. docs/bench) and link them
    plots: bool = True

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for k, typ in (("temperatures", float), ("methods", str), ("batch_sizes", int), ("ks", grid_k),
                       ("peer_dtypes", str), ("peer_ks", int), ("peer_schedules", str),
                       ("peer_temperatures", float), ("tree_branching", int), ("tree_widths", int)):
            set_(k, _tuple(getattr(self, k), typ) or ())
        set_("ks_by_batch", _per_batch(self.ks_by_batch))
        set_("rows_by_batch", _per_batch(self.rows_by_batch))
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"methods must be among {METHODS}, got {bad}")
        empty = [k for k in ("temperatures", "methods", "batch_sizes") if not getattr(self, k)]
        if empty:  # an empty grid would time nothing and write an empty benchmark.json
            raise ValueError(f"{', '.join(empty)} must not be empty")
        for k in ("repeats", "max_new_tokens", "num_prompts", "seed", "tree_topk", "tree_nodes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{k} must be an integer, got {v!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if any(k < 1 for k in self.peer_ks):
            raise ValueError(f"peer_ks must be >= 1, got {list(self.peer_ks)}")
        ks_all = set(self.ks).union(*(set(_as_tuple(v)) for _, v in self.ks_by_batch))
        if any(k != "auto" and k < 1 for k in ks_all) or any(b < 1 for b in self.batch_sizes):
            raise ValueError("K and batch sizes must be >= 1 (or K 'auto')")
        if any(not math.isfinite(t) or t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be finite and >= 0, got {list(self.temperatures)}")
        if self.repeats < 1 or self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError("repeats, max_new_tokens and num_prompts must be >= 1")
        if self.peer_schedules and any(s not in ("constant", "heuristic") for s in self.peer_schedules):
            raise ValueError("peer_schedules must be among constant, heuristic")
        if self.dataset is False:  # `dataset: false` in a config file: off, as None
            object.__setattr__(self, "dataset", None)
        if self.dataset is not None:
            if not isinstance(self.dataset, dict):
                raise ValueError(f"dataset must be a mapping of the dataset workload's settings, or false / "
                                 f"null for none; got {self.dataset!r}")
            self.dataset_spec()  # checked now, before anything loads
        for b in self.batch_sizes:
            if not self.ks_for(b):
                raise ValueError(f"no K to time at batch {b}: give ks (or ks_by_batch[{b}])")
            r = self.rows_for(b)
            if r % b:
                raise ValueError(f"rows_by_batch[{b}] = {r} is not a multiple of the batch size")

    # -- derived --------------------------------------------------------------------------
    def ks_for(self, batch: int) -> tuple:
        """The batch size's grid Ks: the fixed ones in order, then "auto" (its own group)."""
        return tuple(sorted(dict.fromkeys(_as_tuple(dict(self.ks_by_batch).get(batch, self.ks))), key=k_order))

    def rows_for(self, batch: int) -> int:
        r = dict(self.rows_by_batch).get(batch)
        if r is None:
            r = max(batch, (self.num_prompts // batch) * batch)
        return int(r)

    def dataset_spec(self):
        """``(DatasetSpec, prompts_file, num_prompts)`` of the ``dataset`` mapping."""
        from scripts.bench.dataset import DatasetSpec

        d = dict(self.dataset)
        prompts_file = d.pop("prompts_file", DATASET_PROMPTS)
        num_prompts = int(d.pop("num_prompts", 64))
        if num_prompts < 1:
            raise ValueError(f"dataset num_prompts must be >= 1, got {num_prompts}")
        known = {f.name for f in dataclasses.fields(DatasetSpec)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown dataset keys {unknown}; known: prompts_file, num_prompts, {', '.join(sorted(known))}")
        for key in ("settings", "modes", "ladder", "tail_costs"):
            if key in d:
                d[key] = _tuple(d[key], int if key in ("ladder", "tail_costs") else str)
        return DatasetSpec(**d), prompts_file, num_prompts

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


FIELDS = tuple(f.name for f in dataclasses.fields(BenchConfig))


def load_bench_config(name_or_path: str, **overrides) -> BenchConfig:
    """``configs/bench/<name>.yaml`` (or a YAML path) -> :class:`BenchConfig`; ``overrides``
    (None values ignored) replace fields. The name defaults to the file's stem."""
    raw, path = load_config(name_or_path, "bench", allowed=FIELDS, what="benchmark config")
    raw.setdefault("name", path.stem)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return BenchConfig(**raw)


# --------------------------------------------------------------------------------------
# prompts


def read_prompts(path: str) -> list:
    """The non-empty, non-comment lines of a prompts file (relative paths: the checkout)."""
    p = Path(path)
    if not p.is_absolute():
        p = REPO / p
    lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _random_prompts(num_prompts: int, vocab_size: int) -> tuple:
    """``(texts, ids)``: fixed pseudo-random token ids (lengths 6..20), some n-grams repeated."""
    rng = np.random.default_rng(1234)
    texts, ids = [], []
    for i in range(num_prompts):
        n = int(rng.integers(6, 21))
        base = rng.integers(0, vocab_size, size=max(3, n // 2)).tolist()
        row = (base * 3)[:n]
        texts.append(f"<random ids #{i}>")
        ids.append([int(t) for t in row])
    return texts, ids


def build_dataset_prompts(prompts_file: str, num_prompts: int, tokenizer, vocab_size: int) -> tuple:
    """The dataset workload's prompt ids and stop tokens: the file's first ``num_prompts``
    lines in the chat template and the tokenizer's stop ids; without a tokenizer (a random
    model) random prompts as :func:`build_prompts` makes them, with the even ids standing in
    for stop tokens (ragged natural lengths)."""
    if tokenizer is None:
        return _random_prompts(num_prompts, vocab_size)[1], list(range(0, vocab_size, 2))
    texts = read_prompts(prompts_file)[:num_prompts]
    if not texts:
        raise ValueError(f"{prompts_file}: no prompts")
    return [tokenizer.encode_user(t) for t in texts], list(tokenizer.stop_ids)


def build_prompts(cfg: BenchConfig, tokenizer, vocab_size: int) -> tuple:
    """``(texts, token id lists)``: ``num_prompts`` prompts (cycled if the file has fewer).

    Without a tokenizer (``--model tiny``) the prompts are fixed pseudo-random token ids
    (lengths 6..20) with some repeated n-grams so prompt lookup has something to find."""
    if tokenizer is None:
        return _random_prompts(cfg.num_prompts, vocab_size)
    texts = read_prompts(cfg.prompts_file)
    if not texts:
        raise ValueError(f"{cfg.prompts_file}: no prompts")
    texts = [texts[i % len(texts)] for i in range(cfg.num_prompts)]
    if cfg.chat_template:
        ids = [tokenizer.encode_user(t) for t in texts]
    else:
        ids = [tokenizer.encode(t) for t in texts]
    return texts, ids
