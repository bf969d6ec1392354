"""JSON schema of the budget table (`tokenflow calibrate --out budget.json`) and its check.

The schema is a plain dict so that it travels with the code that reads the file. `validate`
uses `jsonschema` when it is installed (it is a dev extra, not a runtime dependency) and
otherwise a small checker that understands exactly the keywords used below (type,
properties, required, items, minimum, exclusiveMinimum, enum): a controller must be able to
refuse a broken table on a machine without the dev tools.
"""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 1
BINDINGS = ("compute", "bandwidth", "kv_capacity")

Schema = dict[str, Any]


def _obj(props: dict[str, Schema]) -> Schema:
    # Every listed key is required: a table missing a field was written by other code.
    return {"type": "object", "properties": props, "required": sorted(props)}


def _list(item: Schema) -> Schema:
    return {"type": "array", "items": item}


_INT0: Schema = {"type": "integer", "minimum": 0}
_INT1: Schema = {"type": "integer", "minimum": 1}
_NUM0: Schema = {"type": "number", "minimum": 0}
_POS: Schema = {"type": "number", "exclusiveMinimum": 0}
_STR: Schema = {"type": "string"}
_FRACTION: Schema = {"type": "number", "minimum": 0, "maximum": 1}

_TIMING = {"mean_s": _POS, "median_s": _POS, "std_s": _NUM0, "bytes_moved": _INT0}
_FIT = _obj({"a": _NUM0, "b": _NUM0, "c": _NUM0, "median_rel_error": _NUM0,
             "max_rel_error": _NUM0})

BUDGET_SCHEMA: Schema = _obj({
    "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
    "created_unix": _NUM0,
    "device_name": _STR,
    "spec": _obj({
        "model": _STR, "dtype": _STR, "device": _STR, "block_size": _INT1,
        "tile_tokens": _INT1, "warmup": _INT0, "iters": _INT1,
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "prefill_tokens": _list(_INT1), "contexts": _list(_INT0),
        "decode_batches": _list(_INT1), "decode_contexts": _list(_INT0),
        "matmul_size": _INT1, "bandwidth_bytes": _INT1,
        "memory_fraction": _FRACTION,
    }),
    "model_stats": _obj({
        "num_params": _INT1, "weight_bytes": _INT1, "weight_bits": _INT1,
        "measured_weight_bits": _INT1, "flops_per_token": _POS, "flops_per_pair": _POS,
        "flops_per_sample": _NUM0, "max_model_len": _INT1,
    }),
    "hardware": _obj({"peak_flops": _POS, "memory_bandwidth": _POS}),
    "kv": _obj({
        "bytes_per_block": _INT1, "memory_budget_bytes": _INT0, "blocks_fit": _INT0,
        "alloc_probe": _list(_obj({"blocks": _INT0, "ok": {"type": "boolean"}})),
        "blocks_allocated": _INT0, "max_blocks_int64": _INT1,
        "max_tokens_int32_offset": _INT1, "capacity_tokens": _INT0,
    }),
    "prefill": _list(_obj({"tokens": _INT1, "context": _INT0, **_TIMING})),
    "decode": _list(_obj({"batch": _INT1, "context": _INT0, **_TIMING})),
    "fit": _obj({
        "prefill": _FIT, "decode": _FIT,
        "bytes": _obj({"weights": _NUM0, "per_token": _NUM0, "per_context_token": _NUM0}),
    }),
    "limits": _obj({"bandwidth_headroom": _FRACTION, "chunk_efficiency": _FRACTION,
                    "plan_context_tokens": _INT0, "plan_decodes": _INT0}),
    "table": _list(_obj({
        "tokens_min": _INT1, "tokens_max": _INT1,
        "binding": {"type": "string", "enum": list(BINDINGS)},
        "compute_s": _NUM0, "bandwidth_s": _NUM0, "predicted_s": _NUM0,
    })),
    "recommendation": _obj({"itl_slo_ms": _POS, "max_num_batched_tokens": _INT1,
                            "chunk_size": _INT1, "limited_by": _STR}),
})

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON true is not a number, although Python says bool is an int
    return isinstance(value, _TYPES[name])


def _check(value: Any, schema: Schema, path: str) -> None:
    types = schema.get("type")
    names = [types] if isinstance(types, str) else list(types or [])
    if names and not any(_is_type(value, n) for n in names):
        raise ValueError(f"{path or '<root>'}: expected {'/'.join(names)}, got {value!r:.60}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{path}: {value!r} not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise ValueError(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ValueError(f"{path}: {value} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise ValueError(f"{path}: {value} <= {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            raise ValueError(f"{path or '<root>'}: missing {missing}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{path}.{key}" if path else key)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]")


def validate(data: Any, use_jsonschema: bool = True) -> None:
    """Raise ValueError when `data` is not a budget table of this schema version."""
    if use_jsonschema:
        try:
            import jsonschema
        except ImportError:
            pass
        else:
            try:
                jsonschema.validate(data, BUDGET_SCHEMA)
            except jsonschema.ValidationError as exc:
                where = ".".join(str(p) for p in exc.absolute_path) or "<root>"
                raise ValueError(f"{where}: {exc.message}") from None
            return
    _check(data, BUDGET_SCHEMA, "")
