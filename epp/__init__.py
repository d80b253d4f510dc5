"""kvrail's Gateway API Inference Extension endpoint picker (EPP).

An EPP is an Envoy ext_proc gRPC service: a GAIE gateway streams each HTTP request through it and
routes the request to the endpoint (``ip:port``) it names. This package speaks that protocol
(version 1) and asks a :class:`kvrail.epp.picker.Picker` for the endpoint. The one picker here
picks the least busy endpoint of a static list; kvrail's KV-aware choice (the router's tokenizer,
pool view and scorers) is the next step and is not built yet.
"""
