"""What a step's program holds. Lowered (`custom_calls`): the custom calls of its StableHLO
module, the Pallas kernels among them and whether each sits in a `shard_map`. Compiled
(`analyze`), read off the target compiler's HLO (`Compiled.as_text()`): its collectives per
chip per step, inside a slice (ICI) and across slices (DCN), and the Mosaic kernels it runs
with the scoped VMEM each was given.

The text is XLA's optimized module for one chip (for a multislice topology: one slice's
program). It is parsed, not executed:

- A computation runs as many times per step as its callers do, and a `while` body (a
  `jax.lax.scan`: the layer stack, the loss chunks) as many times as its loop runs: N - n0 for
  a condition `counter < N` and a counter that starts at the constant n0 (as JAX lowers `scan`
  and `fori_loop`; the compiler may peel iterations off, so n0 need not be 0). A loop of
  another form counts once and is counted in "unknown_trip_counts".
- A collective's bytes are its buffer's, per chip: an all-reduce's (or reduce-scatter's) input,
  an all-gather's output, an all-to-all's or collective-permute's operand: the whole buffer
  that the group reduces or gathers, of which the wire carries about (n-1)/n (x2 for an
  all-reduce) on a ring of n chips. Tile padding (a `T(8,128)` layout) is not counted, except
  where the compiler itself reshaped a buffer to its tiles before sending it.
- ICI: XLA's collective instructions (`all-reduce`, `all-gather`, `reduce-scatter`,
  `all-to-all`, `collective-permute`, their `-start` halves; the TPU compiler's
  `all-reduce-scatter` fusion is one reduce-scatter). DCN: the `send`s that the compiler hands
  to the Megascale runtime (`_xla_megascale_transfer_type`: ALL_REDUCE, ALL_GATHER, ...), one
  per collective across slices (their `recv` halves are not counted twice).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

# An instruction: "%name = shape opcode(operands), attributes" (ROOT optional).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16,
         "u16": 16, "bf16": 16, "f16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b(" + "|".join(_BITS) + r")\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)="
                    r"(\{[^}]*\}|%[^\s,]+)")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions whose called computation is a scalar function they apply, not code that runs.
_APPLIES = ("reduce", "reduce-window", "scatter", "select-and-scatter", "sort", "map")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_KERNEL = re.compile(r'op_name="[^"]*?([A-Za-z0-9_]+)\)*/pallas_call')
_VMEM = re.compile(r'"used_scoped_memory_configs":\[(.*?)\]')


def _bytes(shape: str) -> int:
    """Bytes of the arrays in an HLO shape string (a tuple's elements summed)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8
               for dtype, dims in _ARRAY.findall(shape))


class _Module:
    """The computations of an HLO module's text: {name: [(name, shape, opcode, rest)]}."""

    def __init__(self, text: str):
        self.computations: dict[str, list[tuple[str, str, str, str]]] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            head = _COMPUTATION.match(line)
            if head:
                current = self.computations.setdefault(head[1], [])
                if line.startswith("ENTRY"):
                    self.entry = head[1]
                continue
            if current is not None and (op := _INSTRUCTION.match(line)):
                current.append(op.groups())
            elif current and line.strip() != "}":  # an attribute that spans lines
                name, shape, opcode, rest = current[-1]
                current[-1] = (name, shape, opcode, rest + "\n" + line)
        if self.entry is None:
            raise ValueError("not an HLO module's text: no ENTRY computation")

    def trip_count(self, computation: str, operand: str, condition: str) -> int | None:
        """Iterations of a `while` in `computation` whose init tuple is `operand`: N - n0 of a
        condition `counter < N` (a compare against a constant) with the counter's initial
        value a constant n0 (the compiler peels iterations off: a backward scan's counter may
        start at 1); None when either is not such a constant."""
        constants, counter, bound = {}, None, None
        for name, _shape, opcode, rest in self.computations.get(condition, []):
            if opcode == "constant":
                constants[name] = rest.split(")", 1)[0]
            elif opcode == "get-tuple-element":
                constants[name] = "index " + re.search(r"index=(\d+)", rest)[1]
            elif opcode == "compare" and "direction=LT" in rest:
                a, b = re.findall(r"%([^\s,)]+)", rest.split(")", 1)[0])[:2]
                counter, bound = constants.get(a, ""), constants.get(b, "")
        if not (counter and counter.startswith("index ") and re.fullmatch(r"-?\d+", bound)):
            return None
        start = self._constant(computation, operand, int(counter.split()[1]))
        return None if start is None else int(bound) - start

    def _constant(self, computation: str, name: str, index: int | None = None) -> int | None:
        """The integer constant that `name` (element `index` of a tuple) is, through copies."""
        ops = {n: (opcode, rest) for n, _s, opcode, rest in self.computations[computation]}
        while name in ops:
            opcode, rest = ops[name]
            operands = re.findall(r"%([^\s,)]+)", rest.split(")", 1)[0])
            if opcode == "constant":
                value = rest.split(")", 1)[0]
                return int(value) if re.fullmatch(r"-?\d+", value) else None
            if opcode == "tuple" and index is not None:
                name, index = operands[index], None
            elif opcode in ("copy", "bitcast") and operands:
                name = operands[0]
            else:
                return None
        return None


def analyze(text: str) -> dict[str, Any]:
    """Collectives and kernels of a compiled module's text (`Compiled.as_text()`).

    Returns {"ici": {kind: {"count", "bytes"}}, "dcn": {kind: {"count", "bytes"}}: executions
    and bytes per chip per step, "kernels": {Mosaic kernel name: calls per step},
    "kernel_vmem": {kernel name: most scoped VMEM bytes one call of it was given},
    "loops": {trip count: loops}, "unknown_trip_counts": loops counted once}.
    Raises ValueError for text that is not an HLO module.
    """
    module = _Module(text)
    unknown = 0
    loops: dict[int, int] = defaultdict(int)
    ici: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    dcn: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    kernels: dict[str, int] = defaultdict(int)
    vmem: dict[str, int] = defaultdict(int)

    def visit(computation: str, times: int) -> None:
        nonlocal unknown
        for _name, shape, opcode, rest in module.computations.get(computation, []):
            callees = [c for group in _CALLS.findall(rest)
                       for c in re.findall(r"%([^\s,{}]+)", group)]
            kind = opcode.removesuffix("-start")
            if kind in _COLLECTIVES:
                size = _bytes(_started(opcode, kind, shape)) * (
                    _group_size(rest) if kind == "reduce-scatter" else 1)
                ici[kind]["count"] += times
                ici[kind]["bytes"] += times * size
                continue  # its to_apply is a scalar reduction, not code that runs
            if opcode == "send" and (mega := _MEGASCALE.search(rest)):
                entry = dcn[mega[1].lower().replace("_", "-")]
                entry["count"] += times
                entry["bytes"] += times * _bytes(shape.split("u32[]")[0])
                continue
            if opcode == "fusion" and any(c.startswith("all-reduce-scatter") for c in callees):
                ici["reduce-scatter"]["count"] += times
                ici["reduce-scatter"]["bytes"] += times * sum(
                    _bytes(s) for c in callees for _n, s, op, _r in module.computations[c]
                    if op == "parameter")
                continue
            if opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest:
                name = (_KERNEL.search(rest) or [None, "unnamed"])[1]
                kernels[name] += times
                used = _VMEM.search(rest)
                vmem[name] = max(vmem[name], sum(
                    int(s) for s in re.findall(r'"size":"(\d+)"', used[1] if used else "")))
                continue
            if opcode == "while":
                body = re.search(r"body=%([^\s,]+)", rest)[1]
                condition = re.search(r"condition=%([^\s,]+)", rest)[1]
                trips = module.trip_count(computation, re.match(r"%([^\s,)]+)", rest)[1],
                                          condition)
                if trips is None:
                    unknown += 1
                    trips = 1
                loops[trips] += 1
                visit(body, times * trips)
                continue
            if opcode not in _APPLIES:
                for callee in callees:
                    visit(callee, times)

    visit(module.entry, 1)
    return {"ici": dict(ici), "dcn": dict(dcn), "kernels": dict(kernels),
            "kernel_vmem": dict(vmem), "loops": dict(loops), "unknown_trip_counts": unknown}


def _started(opcode: str, kind: str, shape: str) -> str:
    """The buffer of a collective: an async `-start` of an all-gather or collective-permute
    has the shape (operands, results, contexts); its results (all-gather) or operands
    (collective-permute) are the collective's buffer."""
    if not opcode.endswith("-start") or kind not in ("all-gather", "collective-permute"):
        return shape
    arrays = [m.group(0) for m in _ARRAY.finditer(shape) if m.group(2)]  # not the u32[] contexts
    half = len(arrays) // 2
    return " ".join(arrays[half:] if kind == "all-gather" else arrays[:half])


def _group_size(rest: str) -> int:
    """Devices in each replica group of a collective: `{{0,8},{1,9}}`, the iota form
    `[8,2]<=[16]`, or the named-mesh form `mesh['axis_0'=16,'axis_1'=1] {'axis_0'}`."""
    if (listed := re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)):
        return len(listed[1].split(","))
    if (iota := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)):
        return int(iota[2])
    if (named := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", named[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", named[2]))
    raise ValueError(f"cannot read the replica groups of: {rest[:200]}")


def custom_calls(module) -> dict[str, dict[str, Any]]:
    """The custom calls of a lowered StableHLO module (`Lowered.compiler_ir("stablehlo")`),
    from its `main` through the functions it calls (each call site counted):
    {call target: {"calls": count, "kernels": {kernel name: count} (Mosaic's `kernel_name`,
    Triton's backend_config "name"; calls without one are not listed), "outside_shard_map":
    calls of named kernels not inside an `sdy.manual_computation` (a `shard_map` body, as JAX
    lowers it with Shardy: inline, its kernels there or in functions it calls)}}."""
    from jax._src.lib.mlir import ir  # the MLIR bindings JAX lowers with (no public path)

    found: dict[str, dict[str, Any]] = {}
    functions = {ir.StringAttr(op.operation.attributes["sym_name"]).value: op.operation
                 for op in module.body.operations if op.operation.name == "func.func"}

    def visit(op, manual: bool):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        attrs = child.attributes
                        entry = found.setdefault(ir.StringAttr(attrs["call_target_name"]).value,
                                                 {"calls": 0, "kernels": {},
                                                  "outside_shard_map": 0})
                        entry["calls"] += 1
                        kernel = _kernel_name(attrs, ir)
                        if kernel is not None:
                            entry["kernels"][kernel] = entry["kernels"].get(kernel, 0) + 1
                            entry["outside_shard_map"] += not manual
                    elif child.name == "func.call":
                        callee = ir.FlatSymbolRefAttr(child.attributes["callee"]).value
                        visit(functions[callee], manual)
                    visit(child, manual or child.name == "sdy.manual_computation")

    visit(functions["main"], False)
    return found


def _kernel_name(attrs, ir) -> str | None:
    if "kernel_name" in attrs:  # Mosaic TPU
        return ir.StringAttr(attrs["kernel_name"]).value
    config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
    if isinstance(config, ir.DictAttr) and "name" in config:  # Triton: the kernel's "name"
        return ir.StringAttr(config["name"]).value
    return None
