"""OpenTelemetry tracing of a request across the router and its workers (docs/observability.md).

Off unless `--otlp-traces-endpoint` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_ENDPOINT`) is set: then each process exports its spans over OTLP (http/
protobuf, or grpc by `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`) from a batch thread, and the SDK's
own `OTEL_*` variables apply (sampler: parent-based, always on unless `OTEL_TRACES_SAMPLER`
says otherwise). The router honours an incoming W3C `traceparent` (a malformed one is ignored:
the request starts its own trace) and hands its request span's context to the workers as the
`trace` field of `Admit` and `Prefill` (a traceparent string, never pickled, never on the KV
path); a worker records its phases as spans under it, with the times it measured.

Spans never carry prompt or output text: ids, token counts, workers, bytes, timings.
"""

from __future__ import annotations

import time

from pdserve import envs

_tracer = None  # this process's tracer once `setup` enabled tracing
_propagator = None
# monotonic -> Unix nanoseconds (spans carry wall-clock times; pdserve measures monotonic)
_OFFSET_S = time.time() - time.monotonic()


def setup(service: str, endpoint: str | None = None, exporter=None, **resource: str) -> bool:
    """Turn tracing on for this process when an endpoint is given or set in the environment;
    whether it is on. `service`: its service.name (pdserve-router, pdserve-prefill, ...).
    `exporter`: a span exporter to use instead (unit tests: the SDK's in-memory one, spans
    exported as they end)."""
    global _tracer, _propagator
    endpoint = endpoint or None
    if not (endpoint or exporter or envs.otlp_traces_endpoint()):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        raise ValueError(
            "tracing (--otlp-traces-endpoint, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) needs "
            "opentelemetry-sdk and opentelemetry-exporter-otlp: pip install 'pdserve[otel]', "
            "or unset the endpoint"
        ) from None
    if exporter is not None:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _tracer, _propagator = provider.get_tracer("pdserve"), TraceContextTextMapPropagator()
        return True
    protocol = envs.otlp_traces_protocol()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(
            f"{envs.OTLP_TRACES_PROTOCOL}={protocol!r}: pdserve exports traces over grpc or "
            "http/protobuf"
        )
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    # (shutdown_on_exit: what is still batched is sent on the way out)
    provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer, _propagator = provider.get_tracer("pdserve"), TraceContextTextMapPropagator()
    return True


def enabled() -> bool:
    return _tracer is not None


def disable() -> None:
    """Tracing off again in this process (tests)."""
    global _tracer
    _tracer = None


def _ns(mono: float) -> int:
    return int((mono + _OFFSET_S) * 1e9)


def _context(parent):
    """An OpenTelemetry context from a traceparent string or a header mapping (None: a new
    trace). A malformed traceparent yields an empty context: the span starts its own trace."""
    if parent is None or parent == "":
        return None
    carrier = {"traceparent": parent} if isinstance(parent, str) else parent
    return _propagator.extract(carrier)


def start(name: str, parent=None, at: float | None = None, server: bool = False, **attrs):
    """A span started at monotonic time `at` (now if None) under `parent` (a traceparent
    string, a mapping of headers with one, a span, or None); None while tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, str | dict) and hasattr(parent, "end"):
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = _context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    start_ns = _ns(at if at is not None else time.monotonic())
    return _tracer.start_span(name, ctx, kind, attributes=_clean(attrs), start_time=start_ns)


def end(span, at: float | None = None, **attrs) -> None:
    """End `span` at monotonic time `at` (now), with `attrs` added; None is ignored."""
    if span is None:
        return
    if attrs:
        span.set_attributes(_clean(attrs))
    span.end(end_time=_ns(at if at is not None else time.monotonic()))


def event(span, name: str, at: float | None = None, **attrs) -> None:
    """A point in a span's life (migration, fallback, abort, ...); None is ignored."""
    if span is not None:
        span.add_event(name, _clean(attrs), _ns(at if at is not None else time.monotonic()))


def record(name: str, parent: str, begin: float, finish: float, events=(), **attrs) -> None:
    """A finished span from `begin` to `finish` (monotonic) under traceparent `parent`, as a
    worker reports a phase it timed; `events`: (name, at, attrs) triples. Nothing while
    tracing is off or without a parent."""
    if _tracer is None or not parent:
        return
    span = start(name, parent, begin, **attrs)
    for ev, at, ev_attrs in events:
        event(span, ev, at, **ev_attrs)
    end(span, max(begin, finish))


def traceparent(span) -> str:
    """The W3C traceparent of `span`, for the control messages ("" without a span)."""
    if span is None:
        return ""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def _clean(attrs: dict) -> dict:
    """Attributes under pdserve's namespace (`request_id` -> `pdserve.request_id`); None
    values are left out (OpenTelemetry takes none)."""
    return {f"pdserve.{k}": v for k, v in attrs.items() if v is not None}
