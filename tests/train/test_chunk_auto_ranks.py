"""``batch.chunk_size: "auto"`` on ranks whose probes walked different ways: a rank with less free
memory walks down from the start chunk while the others walk up, so the ranks measured different
chunks; a chunk smaller than one that fit on a rank fits there too (one chunk's activations grow
with the chunk), so the run must not fail for want of a chunk every rank measured."""

from ds_infcl.train.chunk_auto import ChunkTiming, candidate_chunks, choose_chunk, probe_chunks


def _probe(limit, speed):
    """A rank's probe where chunks up to ``limit`` fit, timed by ``speed(c)``."""
    return probe_chunks(candidate_chunks(4096), lambda c: ChunkTiming(c, speed(c), peak_bytes=c),
                        lambda t: t.peak_bytes <= limit)


def test_a_rank_that_walked_down_and_one_that_walked_up_agree_on_a_chunk():
    tight = _probe(32, lambda c: float(c))  # measures 64 (does not fit), then 32
    roomy = _probe(256, lambda c: float(c))  # measures 64, 128, 256, 512 (does not fit)
    assert [t.chunk for t in tight] == [32, 64] and [t.chunk for t in roomy] == [64, 128, 256, 512]
    assert choose_chunk([tight, roomy]) == 32
    assert choose_chunk([roomy, tight]) == 32


def test_a_chunk_is_not_taken_where_nothing_at_or_above_it_fit():
    r0 = [ChunkTiming(32, 10.0, fits=True), ChunkTiming(64, 0.0, oom=True)]
    r1 = [ChunkTiming(16, 10.0, fits=True), ChunkTiming(32, 0.0, fits=False)]
    assert choose_chunk([r0, r1]) == 16  # fits on r1 (measured) and on r0 (below its 32)
    r1 = [ChunkTiming(16, 10.0, fits=False)]
    assert choose_chunk([r0, r1]) is None
