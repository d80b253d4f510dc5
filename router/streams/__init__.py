"""One request stream to a worker: the dispatcher that opens it, the stream over NATS for
kvrail workers and over HTTP for vLLM servers, and the retry loop they share."""
