"""An OTLP/HTTP trace receiver on a free port, for the tests that turn tracing on
(tests/serving/test_observability.py, tests/chaos): every span it was sent, with the process
that sent it. Needs the OpenTelemetry protobufs (pdserve[otel]); import it after
`pytest.importorskip`."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


class Got(NamedTuple):
    """A span as received: its process's service.name (pdserve-router, pdserve-decode, ...),
    the worker id its resource names ("" for the router), and the span."""

    service: str
    worker: str
    span: object


class Receiver:
    """`url`: its /v1/traces endpoint; `spans`: every span received, in arrival order."""

    def __init__(self):
        self.spans: list[Got] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    svc, worker = attrs["service.name"], attrs.get("pdserve.worker_id", "")
                    for ss in rs.scope_spans:
                        receiver.spans.extend(Got(svc, worker, s) for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes) -> list[Got]:
        """The spans received so far of one trace."""
        return [g for g in list(self.spans) if g.span.trace_id == trace_id]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def attrs(span) -> dict:
    """A span's (or event's) attributes, `pdserve.` stripped, as Python values."""
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key.removeprefix("pdserve.")] = getattr(a.value, kind) if kind else None
    return out
