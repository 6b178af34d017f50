"""An OTLP/HTTP trace receiver on a free port of this machine, for the benchmarks that turn
tracing on (tracing_overhead.py, observability_example.py): it keeps every span it is sent."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """`url`: its /v1/traces endpoint; `spans`: (service.name, span) as they arrive."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        self.spans: list[tuple[str, object]] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                for rs in pb.ExportTraceServiceRequest.FromString(body).resource_spans:
                    svc = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")  # fmt: skip
                    rec.spans.extend((svc, s) for ss in rs.scope_spans for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
