"""Render a Triton model configuration, given as a protobuf-JSON-style dict, as ``config.pbtxt`` text.

The same dict is what the repository API's load override takes (``{"config": json.dumps(d)}``), so one
representation serves both: enums are strings ("TYPE_INT32", "KIND_CPU"), map fields (``parameters``)
are JSON objects, repeated messages are lists of dicts. Only the shapes a model config uses are
supported; tests parse the output with Triton's own ``ModelConfig`` protobuf schema.
"""

from __future__ import annotations

import json
from typing import Any

from serving.triton.errors import ConfigError

# Fields whose string values are protobuf enum names, written without quotes.
ENUM_FIELDS = frozenset({"data_type", "kind", "format", "timeout_action", "priority"})
# Fields that are protobuf maps: a JSON object becomes repeated ``{ key: ..., value: ... }`` entries.
MAP_FIELDS = frozenset({"parameters", "cc_model_filenames", "metric_tags", "priority_queue_policy"})

_INDENT = "  "


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if key in ENUM_FIELDS:
            if not value.replace("_", "").isalnum():
                raise ConfigError(f"enum value {value!r} of field {key!r} is not an identifier")
            return value
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid protobuf text escapes
    raise ConfigError(f"unsupported value {value!r} ({type(value).__name__}) for field {key!r}")


def _message(d: dict[str, Any], depth: int) -> list[str]:
    lines: list[str] = []
    pad = _INDENT * depth
    for key, value in d.items():
        if value is None:
            continue
        if key in MAP_FIELDS and isinstance(value, dict):
            for map_key, map_value in value.items():
                entry = {"key": str(map_key), "value": map_value}
                lines.append(f"{pad}{key} {{")
                lines.extend(_message(entry, depth + 1))
                lines.append(f"{pad}}}")
        elif isinstance(value, dict):
            lines.append(f"{pad}{key} {{")
            lines.extend(_message(value, depth + 1))
            lines.append(f"{pad}}}")
        elif isinstance(value, (list, tuple)):
            if all(isinstance(v, dict) for v in value) and value:
                for item in value:
                    lines.append(f"{pad}{key} {{")
                    lines.extend(_message(item, depth + 1))
                    lines.append(f"{pad}}}")
            else:
                lines.append(f"{pad}{key}: [{', '.join(_scalar(key, v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar(key, value)}")
    return lines


def to_pbtxt(config: dict[str, Any]) -> str:
    """Return the protobuf text form of a model config dict."""
    return "\n".join(_message(config, 0)) + "\n"
