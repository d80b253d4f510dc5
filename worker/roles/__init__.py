"""What a worker process does with its engine: the decode role (admit, prefill locally or
remotely, stream tokens), the prefill role (pull jobs, compute, write KV into a decode worker's
blocks), and what they share (peers, cancels, KV events, the context built once per process).
"""
