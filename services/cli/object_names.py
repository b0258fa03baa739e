"""Kubernetes' rules for object names, checked before anything is sent: the same wording as
the API server's validation, so that a bad name reads as kubectl users know it."""

from __future__ import annotations

import re

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def namespace_problem(value: object) -> str | None:
    """Why `value` is not a namespace (an RFC 1123 label), or None."""
    if not isinstance(value, str) or len(value) > 63 or not _LABEL.fullmatch(value):
        return (
            f"metadata.namespace: Invalid value: {value!r}: a namespace must be a lowercase "
            "RFC 1123 label: at most 63 characters of a-z, 0-9 and '-', starting and ending "
            "with a letter or digit (e.g. 'my-team')"
        )
    return None


def name_problem(value: object) -> str | None:
    """Why `value` is not a pod name (an RFC 1123 subdomain), or None."""
    if not isinstance(value, str) or len(value) > 253 or not _SUBDOMAIN.fullmatch(value):
        return (
            f"metadata.name: Invalid value: {value!r}: a pod name must be a lowercase RFC 1123 "
            "subdomain: at most 253 characters of a-z, 0-9, '-' and '.', each part starting "
            "and ending with a letter or digit (e.g. 'train-1')"
        )
    return None
