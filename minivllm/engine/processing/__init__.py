"""The boundary between callers and the engine: a request tokenized, validated and made into `Sequence`s
(n of them for n > 1) on the way in; committed sequences detokenized into `RequestOutput`s on the way out.

It imports request/ and structured_output/ (a request's grammar is compiled at the boundary), nothing of
core/ or worker/: what it asks of the scheduler's KV pool it names by a protocol (`KVPool`)."""
