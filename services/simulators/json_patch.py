"""RFC 6902 JSON patch, as the API server applies it (admission webhooks' patches, clients'
PATCH requests with application/json-patch+json)."""

from __future__ import annotations

import copy
from typing import Any


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch: add, replace, remove, test (what admission and clients use)."""
    document = copy.deepcopy(target)
    if not isinstance(operations, list):
        raise ValueError("a JSON patch is a list of operations")
    for op in operations:
        parts = _pointer(op["path"])
        parent = document
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if kind in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, op["value"])
                else:
                    parent[index] = op["value"]
            else:
                if kind == "replace" and last not in parent:
                    raise ValueError(f"replace: {op['path']} does not exist")
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            else:
                del parent[last]
        elif kind == "test":
            value = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if value != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unsupported JSON patch op {kind!r}")
    return document
