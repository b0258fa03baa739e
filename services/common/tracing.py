"""OpenTelemetry setup and W3C trace-context helpers for NATS headers, HTTP and gRPC.

One trace follows a pod: the allocator keeps the traceparent of the pod's scheduling span in
its allocation record, and later steps (the node agent's Allocate) parent their spans on it.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured: TracerProvider | None = None


def setup_tracing(
    service_name: str,
    otlp_endpoint: str = "",
    extra_processor: SpanProcessor | None = None,
) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls add processors only.

    An OTLP/gRPC exporter is attached when an endpoint is given; without one spans are
    still created (and carried across services) but not exported.
    """
    global _configured
    if _configured is None:
        _configured = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(_configured)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
            _configured.add_span_processor(BatchSpanProcessor(exporter))
    if extra_processor is not None:
        _configured.add_span_processor(extra_processor)
    return _configured


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (traceparent/tracestate)."""
    carrier: dict[str, str] = dict(headers or {})
    inject(carrier)
    return carrier


def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context:
    return extract(dict(headers or {}))


def current_traceparent() -> str:
    return inject_headers().get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    if not traceparent:
        return otel_context.Context()
    return extract({"traceparent": traceparent})
