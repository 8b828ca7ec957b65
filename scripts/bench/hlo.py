"""What a compiled XLA program launches: a reader of the optimized HLO text
(``jax.jit(f).lower(...).compile().as_text()``), for any backend.

Counts, per iteration of each ``while`` loop, the operations that run as their own kernel
on a GPU (fusions, library calls, copies, sorts, ...; a ``while`` with a known trip count
counted that many times over, a ``conditional`` by its largest or its smallest branch), the
host syncs
(XLA's GPU runtime copies the predicate of every ``conditional`` and of every ``while``
without a known trip count to the host and waits for the stream before it goes on), the
bytes the kernels name (operands + result: an upper bound on what they move) and where the
kernels come from (the innermost frame of the project's own source in their stack).

A reading of the program, not a timing: on the device XLA may run several of these
operations as one CUDA graph, and a library call may launch more than one kernel.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional

# operations that launch nothing: views, tuples, parameters and scheduling markers
FREE_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
    "copy-done", "slice-done", "send-done", "recv-done", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "async-done", "async-update",
})

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}

_COMP_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> (.*) \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    shape: str
    rest: str  # operands and attributes, as written
    root: bool = False

    @property
    def operands(self) -> list[str]:
        head = _balanced(self.rest, 0)
        return re.findall(r"%([\w.\-]+)", head)

    def attr(self, key: str) -> Optional[str]:
        m = re.search(r"\b" + re.escape(key) + r"=(%?[\w.\-]+|\{[^}]*\})", self.rest)
        return m.group(1) if m else None

    def called(self) -> list[str]:
        """Computations this instruction runs (bodies, branches, fused computations)."""
        out = []
        for key in ("calls", "body", "condition", "to_apply", "true_computation",
                    "false_computation", "branch_computations"):
            v = self.attr(key)
            if v:
                out += [c.lstrip("%") for c in re.findall(r"%?[\w.\-]+", v.strip("{}"))]
        return out

    def _int(self, pattern: str, default=None):
        m = re.search(pattern, self.rest)
        return int(m.group(1)) if m else default

    @property
    def trip_count(self) -> Optional[int]:
        """XLA's annotation of a ``while``'s trip count (GPU, CPU), if any."""
        return self._int(r'"known_trip_count":\{"n":"(\d+)"')

    @property
    def estimated_cycles(self) -> int:
        return self._int(r'"estimated_cycles":"(\d+)"', 0)

    @property
    def frame(self) -> Optional[int]:
        return self._int(r"stack_frame_id=(\d+)")

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.rest)
        return m.group(1) if m else ""

    @property
    def custom_call_target(self) -> str:
        m = re.search(r'custom_call_target="([^"]*)"', self.rest)
        return m.group(1) if m else ""


def _balanced(s: str, start: int) -> str:
    """The text of the parenthesized group that opens at or after ``start``."""
    i = s.index("(", start)
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j]
    return s[i + 1:]


def _split_shape(text: str) -> tuple[str, str]:
    """``"f32[2]{0} add(%a, %b), ..."`` -> ``("f32[2]{0}", "add(%a, %b), ...")``."""
    if text.startswith("("):
        inner = _balanced(text, 0)
        return "(" + inner + ")", text[len(inner) + 2:].lstrip()
    shape, _, rest = text.partition(" ")
    return shape, rest


def tuple_elements(shape: str) -> list:
    """The top-level elements of a tuple shape (``"(a, (b, c), d)"`` -> ``["a", "(b, c)",
    "d"]``); an array shape is its own one element."""
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape[1:-1], 1):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(shape[start:i].strip())
            start = i + 1
    out.append(shape[start:-1].strip())
    return [e for e in out if e]


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (tuples summed)."""
    total = 0
    for dt, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dt, 1 if dt.startswith("f8") else 4)
    return total


@dataclasses.dataclass
class Module:
    computations: dict  # name -> list[Instr]
    entry: str
    frames: dict  # stack frame id -> (file, function, line, parent id)

    def source(self, ins: Instr, roots=("specjax", "models", "scripts")) -> str:
        """``file:function`` of the innermost frame of ``ins``'s stack whose file lies under
        one of ``roots`` (the project's own code), else of the innermost frame. (XLA prints a
        frame's ``parent_frame_id`` as the parent's id plus one: 1 means none.)"""
        fid, first = ins.frame, None
        seen = set()
        while fid and fid in self.frames and fid not in seen:
            seen.add(fid)
            f, fn, line, parent = self.frames[fid]
            parts = f.replace("\\", "/").split("/")
            short = "/".join(parts[-2:])
            first = first or f"{short}:{fn}"
            if any(r in parts[:-1] for r in roots):
                return f"{short}:{fn}"
            fid = parent - 1
        return first or (ins.op_name.split("/")[-1] if ins.op_name else "?")


def parse(text: str) -> Module:
    """Parse the text of a compiled (or any) HLO module."""
    comps, entry, cur = {}, None, None
    files, funcs, locs, frames = {}, {}, {}, {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and line[0].isdigit():
            num, _, val = line.partition(" ")
            num = int(num)
            if section == "FileNames":
                files[num] = val.strip('"')
            elif section == "FunctionNames":
                funcs[num] = val.strip('"')
            elif section == "FileLocations":
                d = dict(re.findall(r"(\w+)=(\d+)", val))
                locs[num] = (int(d.get("file_name_id", 0)), int(d.get("function_name_id", 0)),
                             int(d.get("line", 0)))
            else:
                d = dict(re.findall(r"(\w+)=(\d+)", val))
                frames[num] = (int(d.get("file_location_id", 0)), int(d.get("parent_frame_id", 0)))
            continue
        m = _COMP_HEAD.match(line)
        if m:
            section = None
            cur = comps.setdefault(m.group(2), [])
            if m.group(1):
                entry = m.group(2)
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            m = _INSTR.match(line)
            if m:
                shape, rest = _split_shape(m.group(3))
                op = re.match(r"([\w\-]+)\(", rest)
                if op:
                    cur.append(Instr(m.group(2), op.group(1), shape, rest[len(op.group(1)):],
                                     root=bool(m.group(1))))
    fr = {}
    for fid, (loc, parent) in frames.items():
        fname, fn, line = locs.get(loc, (0, 0, 0))
        fr[fid] = (files.get(fname, "?"), funcs.get(fn, "?"), line, parent)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return Module(comps, entry, fr)


@dataclasses.dataclass
class Tally:
    """What one pass over a computation launches (nested loops and branches expanded)."""

    kernels: int = 0
    syncs: int = 0
    bytes: int = 0
    cycles: int = 0  # the compiler's own estimate where it writes one (XLA:TPU)
    copies: int = 0
    copy_bytes: int = 0
    by_source: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, other: "Tally", times: int = 1) -> None:
        self.kernels += times * other.kernels
        self.syncs += times * other.syncs
        self.cycles += times * other.cycles
        self.bytes += times * other.bytes
        self.copies += times * other.copies
        self.copy_bytes += times * other.copy_bytes
        for k, v in other.by_source.items():
            self.by_source[k] += times * v
        for k, v in other.by_kind.items():
            self.by_kind[k] += times * v


def kind_of(ins: Instr) -> str:
    """A short name for what kind of kernel ``ins`` is."""
    if ins.opcode == "fusion":
        m = re.search(r'"kind":"([\w$]+)"', ins.rest)
        if m and "gemm" in m.group(1):
            return "gemm (triton)"
        k = ins.attr("kind") or ""
        return {"kLoop": "loop fusion", "kInput": "reduction fusion", "kOutput": "output fusion",
                "kCustom": "custom fusion"}.get(k, "fusion")
    if ins.opcode == "custom-call":
        return "gemm (cublas)" if _library_gemm(ins) else f"custom-call {ins.custom_call_target}"
    return ins.opcode


def _library_gemm(ins: Instr) -> bool:
    """Whether ``ins`` is a call of cuBLAS / cuBLASLt's matmul (which returns a workspace
    beside its result)."""
    return ins.opcode == "custom-call" and "cublas" in ins.custom_call_target.lower()


_SLICES = ("dynamic-slice", "slice", "gather")
_VIEWS = ("bitcast", "reshape", "copy", "convert")


def _param_read(mod: Module, comp: str, index: int, full: int, depth: int = 0) -> int:
    """Bytes a fused computation reads of its parameter ``index`` (``full`` bytes): only
    the slices where every use is a slice (through views), nothing where it is the
    operand updated in place by a dynamic-update-slice or a scatter."""
    instrs = mod.computations.get(comp, [])
    param = next((i.name for i in instrs if i.opcode == "parameter"
                  and re.match(rf"\({index}\)", i.rest)), None)
    if param is None or depth > 4:
        return full
    outputs = _outputs(instrs)
    total, frontier = 0, [param]
    while frontier:
        cur = frontier.pop()
        for u in instrs:
            ops = u.operands
            if cur not in ops:
                continue
            if u.opcode in _VIEWS:
                frontier.append(u.name)
            elif u.opcode in _SLICES and ops[0] == cur:
                total += shape_bytes(u.shape)
            elif u.opcode in ("dynamic-update-slice", "scatter") and ops[0] == cur and u.name in outputs:
                pass  # updated in place (the fusion's result): only the update is written
            elif u.opcode == "fusion":
                called = u.called()
                sub = called[0] if called else ""
                for j, o in enumerate(ops):
                    if o == cur:
                        total += _param_read(mod, sub, j, full, depth + 1)
            else:
                return full
    return min(total, full)


def _outputs(instrs: list) -> set:
    """Names of what a computation returns: its root, the elements of a root tuple, and
    what those are views of."""
    by = {i.name: i for i in instrs}
    out, todo = set(), [i.name for i in instrs if i.root]
    while todo:
        n = todo.pop()
        if n in out or n not in by:
            continue
        out.add(n)
        i = by[n]
        if i.opcode == "tuple" or (i.opcode in ("bitcast", "reshape") and i.operands):
            todo += i.operands
    return out


def _through(instrs: dict, name: str, opcodes: tuple) -> Optional[Instr]:
    """The instruction ``name`` is, followed back through ``opcodes`` (views, copies) to
    what they take (None where it leaves ``instrs``)."""
    i = instrs.get(name)
    while i is not None and i.opcode in opcodes and i.operands:
        i = instrs.get(i.operands[0])
    return i


def _from_parameter(instrs: dict, name: str) -> bool:
    """Whether ``name`` is a parameter of the computation, through views."""
    i = _through(instrs, name, ("bitcast", "reshape"))
    return i is not None and i.opcode == "parameter"


def _written(mod: Module, comp: str, ins_shape: str) -> int:
    """Bytes a fused computation writes: the updates of in-place dynamic-update-slices and
    scatters at its root (through tuples and views), the whole result otherwise."""
    instrs = {i.name: i for i in mod.computations.get(comp, [])}
    root = [i for i in mod.computations.get(comp, []) if i.root]
    if not root:
        return shape_bytes(ins_shape)

    def out(i):
        if i.opcode == "tuple":
            return sum(out(instrs[o]) if o in instrs else 0 for o in i.operands)
        if i.opcode in ("bitcast", "reshape") and i.operands and i.operands[0] in instrs:
            return out(instrs[i.operands[0]])
        # in place only where the updated operand is one of the fusion's own inputs
        if (i.opcode == "dynamic-update-slice" and len(i.operands) > 1 and i.operands[1] in instrs
                and _from_parameter(instrs, i.operands[0])):
            return shape_bytes(instrs[i.operands[1]].shape)
        if (i.opcode == "scatter" and len(i.operands) == 3 and i.operands[2] in instrs
                and _from_parameter(instrs, i.operands[0])):
            return shape_bytes(instrs[i.operands[2]].shape)
        return shape_bytes(i.shape)

    return out(root[0])


def kernel_bytes(mod: Module, ins: Instr, shapes: dict) -> int:
    """Bytes a kernel moves, as far as the HLO says: its result (or the in-place updates
    it writes) and its operands (or the slices of them it reads)."""
    operands = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
    if ins.opcode.endswith("-start") and ins.shape.startswith("("):
        # an asynchronous start's result is (its operands, its results, context): the
        # operands are named again, not written; a slice-start reads only its slice
        out = sum(shape_bytes(e) for e in tuple_elements(ins.shape)[1:])
        return 2 * out if ins.opcode == "slice-start" else out + sum(operands)
    if ins.opcode in ("slice", "dynamic-slice"):  # reads its slice (and the start indices)
        return 2 * shape_bytes(ins.shape) + sum(operands[1:])
    if ins.opcode == "dynamic-update-slice" and len(operands) > 1:  # in place: the update, twice
        return 2 * operands[1] + sum(operands[2:])
    if ins.opcode != "fusion" or not ins.called():
        out = shape_bytes(ins.shape)
        if _library_gemm(ins):
            ws = re.search(r", s8\[\d+\]\{0\}\)$", ins.shape)  # the library's workspace, not data
            out -= shape_bytes(ws.group(0)) if ws else 0
        return out + sum(operands)
    comp = ins.called()[0]
    return _written(mod, comp, ins.shape) + sum(
        _param_read(mod, comp, j, full) for j, full in enumerate(operands))


def trip_count(mod: Module, ins: Instr, comp: str) -> Optional[int]:
    """The trip count of ``while`` instruction ``ins`` (in computation ``comp``): XLA's
    annotation (GPU, CPU), else read off the loop (XLA:TPU writes none): a condition
    ``i < N`` on a tuple element that starts at the constant 0 (through copies) and that the
    body moves on by ``i + 1``."""
    if ins.trip_count is not None:
        return ins.trip_count
    cond = {i.name: i for i in mod.computations.get(ins.attr("condition").lstrip("%"), [])}
    root = next((i for i in cond.values() if i.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.rest:
        return None
    a, b = (cond.get(o) for o in root.operands[:2])
    if not (a and b and a.opcode == "get-tuple-element" and b.opcode == "constant"):
        return None
    n = re.match(r"\((-?\d+)\)", b.rest)
    idx = re.search(r"index=(\d+)", a.rest)
    here = {i.name: i for i in mod.computations.get(comp, [])}
    init = here.get(ins.operands[0]) if ins.operands else None
    if not (n and idx and init is not None and init.opcode == "tuple"):
        return None
    start = _through(here, init.operands[int(idx.group(1))], ("copy",))
    if start is None or start.opcode != "constant" or not re.match(r"\(0\)", start.rest):
        return None
    # ... and that the body moves it on: element i of the body's result is element i + 1
    body = {i.name: i for i in mod.computations.get(ins.attr("body").lstrip("%"), [])}
    out = next((i for i in body.values() if i.root), None)
    if out is None or out.opcode != "tuple" or len(out.operands) <= int(idx.group(1)):
        return None
    step = body.get(out.operands[int(idx.group(1))])

    def is_counter(name):
        i = _through(body, name, ("copy",))
        return (i is not None and i.opcode == "get-tuple-element"
                and re.search(rf"index={idx.group(1)}\b", i.rest) is not None)

    def is_one(name):
        i = body.get(name)
        return i is not None and i.opcode == "constant" and re.match(r"\(1\)", i.rest) is not None

    if step is None or step.opcode != "add" or len(step.operands) != 2:
        return None
    a, b = step.operands
    if not ((is_counter(a) and is_one(b)) or (is_counter(b) and is_one(a))):
        return None
    return max(int(n.group(1)), 0)


def _iteration(mod: Module, ins: Instr, trips: Optional[int], memo: dict, branch) -> Tally:
    """One iteration of ``while`` instruction ``ins``: its body, and where its trip count
    is unknown (``trips`` None) its condition and the host sync that reads the predicate."""
    it = Tally()
    it.add(tally(mod, ins.attr("body").lstrip("%"), memo, branch))
    if trips is None:
        it.add(tally(mod, ins.attr("condition").lstrip("%"), memo, branch))
        it.syncs += 1
    return it


def tally(mod: Module, comp: str, _memo=None, branch=max) -> Tally:
    """Kernels, syncs and bytes of one pass over computation ``comp``; of a conditional's
    branches the one ``branch`` picks by kernels (``max``: the largest, ``min``: the
    smallest: the range a pass may cost when the branch taken depends on the data)."""
    memo = {} if _memo is None else _memo
    if comp in memo:
        return memo[comp]
    t = Tally()
    shapes = {i.name: i.shape for i in mod.computations.get(comp, [])}
    for ins in mod.computations.get(comp, []):
        if ins.opcode in FREE_OPS:
            continue
        if ins.opcode == "while":
            n = trip_count(mod, ins, comp)
            t.add(_iteration(mod, ins, n, memo, branch), 1 if n is None else n)
            continue
        if ins.opcode == "conditional":
            branches = [tally(mod, c, memo, branch) for c in ins.called()]
            if branches:
                t.add(branch(branches, key=lambda b: (b.kernels, b.bytes)))
            t.syncs += 1
            continue
        if ins.opcode == "call":
            for c in ins.called():
                t.add(tally(mod, c, memo, branch))
            continue
        b = kernel_bytes(mod, ins, shapes)
        t.kernels += 1
        t.bytes += b
        t.cycles += ins.estimated_cycles
        t.by_source[mod.source(ins)] += 1
        t.by_kind[kind_of(ins)] += 1
        if ins.opcode == "copy" or (ins.opcode == "fusion" and ins.name.startswith("copy")):
            t.copies += 1
            t.copy_bytes += shape_bytes(ins.shape)
    memo[comp] = t
    return t


@dataclasses.dataclass
class Loop:
    """A ``while`` loop of the program and one iteration's tally (its condition included:
    the predicate read on the host each iteration is one of ``syncs``), with the largest
    branch of every conditional (``per_iteration``) and with the smallest (``least``)."""

    name: str
    computation: str  # where the while instruction is
    depth: int
    trip_count: Optional[int]
    per_iteration: Tally
    least: Tally
    source: str


def loops(mod: Module) -> list[Loop]:
    """Every ``while`` reachable from the entry (outermost first), with one iteration's tally."""
    out, memos = [], {max: {}, min: {}}

    def walk(comp, depth, seen):
        for ins in mod.computations.get(comp, []):
            if ins.opcode == "while":
                n = trip_count(mod, ins, comp)
                out.append(Loop(ins.name, comp, depth, n, _iteration(mod, ins, n, memos[max], max),
                                _iteration(mod, ins, n, memos[min], min), mod.source(ins)))
            if ins.opcode in ("while", "conditional", "call"):
                for c in ins.called():
                    if c not in seen:
                        walk(c, depth + (ins.opcode == "while"), seen | {c})

    walk(mod.entry, 0, {mod.entry})
    return out


def main_loop(mod: Module) -> Optional[Loop]:
    """The decode loop: of the loops without a known trip count, the one whose iteration
    launches the most kernels (a speculative round, a decode step)."""
    cands = [lp for lp in loops(mod) if lp.trip_count is None]
    return max(cands, key=lambda lp: lp.per_iteration.kernels) if cands else None
