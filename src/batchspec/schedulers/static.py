"""Static batching: consecutive groups of ``batch_size`` requests, in input order."""


def static_batches(n_requests: int, batch_size: int):
    for start in range(0, n_requests, batch_size):
        yield list(range(start, min(start + batch_size, n_requests)))
