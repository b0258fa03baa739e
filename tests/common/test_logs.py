"""Log lines carry their fields (pod, node, GPU, reason) in both formats: JSON for machines,
key=value after the message for people at a terminal (`vgpu up`'s default)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from services.common.logs import JsonFormatter, TextFormatter, add_context_fields, log_fields


def record(message: str, **fields: object) -> logging.LogRecord:
    return logging.getLogger("vgpu.test").makeRecord(
        "vgpu.test", logging.INFO, __file__, 1, message, (), None, extra=fields
    )


def test_text_lines_name_their_fields_after_the_message() -> None:
    line = TextFormatter().format(record(
        "pod released", pod="default/half-gpu", node="node-1", gpus=["GPU-1"],
        reason="pod deleted", uid="u1",
    ))  # fmt: skip
    assert line.endswith(
        ' INFO vgpu.test: pod released pod=default/half-gpu node=node-1 gpus=["GPU-1"] '
        'reason="pod deleted" uid=u1'
    )


def test_text_values_stay_one_token_each() -> None:
    line = TextFormatter().format(record("x", reason='a "quoted" = b', empty="", n=3))
    assert line.endswith(' x reason="a \\"quoted\\" = b" empty="" n=3')
    assert TextFormatter().format(record("no fields")).endswith(" INFO vgpu.test: no fields")


def test_a_traceback_stays_below_the_fields() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.getLogger("vgpu.test").makeRecord(
            "vgpu.test", logging.ERROR, __file__, 1, "relay task failed", (), sys.exc_info(),
            extra={"node": "node-1"},
        )  # fmt: skip
    first, *rest = TextFormatter().format(failed).splitlines()
    assert first.endswith("relay task failed node=node-1")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"


def test_json_lines_carry_the_same_fields() -> None:
    entry = json.loads(JsonFormatter().format(record("pod bound", pod="ns/p", node="n1")))
    assert (entry["msg"], entry["pod"], entry["node"], entry["level"]) == (
        "pod bound", "ns/p", "n1", "info")  # fmt: skip


async def test_a_context_names_the_node_of_every_line_logged_within_it() -> None:
    logger = logging.getLogger("vgpu.test.context")
    add_context_fields(logger)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    logger.addHandler(handler)
    try:
        with log_fields(node="node-1"):
            logger.warning("inside")
            logger.warning("its own node wins", extra={"node": "node-9"})
            # Tasks and threads started within inherit it (an agent's loops and NVML calls).
            await asyncio.create_task(asyncio.to_thread(logger.warning, "in a thread"))
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    assert [(r.getMessage(), getattr(r, "node", None)) for r in seen] == [
        ("inside", "node-1"), ("its own node wins", "node-9"), ("in a thread", "node-1"),
        ("outside", None),
    ]  # fmt: skip
