"""The paged pools against a NumPy construction: gather = the contiguous bank, scatter writes the new
rows where the page tables say, padding rows read zeros and write nothing; the paged bank of calls
of several tokens (contiguous KDA states, the MLA pools as they are); prefill pieces."""
import jax.numpy as jnp
import numpy as np

from k3jax.memory import MLAPages
from k3jax.sessions.paged import Pools, gather_bank, paged_bank, piece_lengths, scatter_bank, scatter_paged
from k3jax.sessions.pools import RefCounts

SLOTS, PAGES, PAGE, WIDTH = 3, 5, 4, 2


def random_pools(rng) -> Pools:
    return Pools(state=rng.normal(size=(SLOTS, 2, 1, 2, 2)).astype(np.float32),
                 conv=rng.normal(size=(SLOTS, 2, 3, 6)).astype(np.float32),
                 latent=rng.normal(size=(1, PAGES, PAGE * WIDTH)).astype(np.float32))     # a page: one row


def pages_of(latent: np.ndarray) -> np.ndarray:
    """The latent pool as [layer, page, row in page, L]."""
    return latent.reshape(1, PAGES, PAGE, WIDTH)


def test_gather_is_the_contiguous_bank_and_padding_reads_zeros():
    rng = np.random.default_rng(0)
    pools = random_pools(rng)
    slots, tables, lengths = np.array([2, SLOTS]), np.array([[4, 1], [PAGES, PAGES]]), np.array([6, 0])
    bank = gather_bank(Pools(*map(jnp.asarray, pools)), jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lengths), WIDTH)
    np.testing.assert_array_equal(bank.kda.state[:, 0], pools.state[2])
    np.testing.assert_array_equal(bank.kda.state[:, 1], 0)
    np.testing.assert_array_equal(bank.mla.latent[0, 0], np.concatenate([pages_of(pools.latent)[0, 4], pages_of(pools.latent)[0, 1]]))
    np.testing.assert_array_equal(bank.mla.latent[0, 1], 0)
    np.testing.assert_array_equal(bank.mla.length, [[6, 0]])


def test_scatter_writes_new_rows_into_their_pages_only():
    rng = np.random.default_rng(1)
    pools = random_pools(rng)
    slots, tables, lengths = np.array([1, SLOTS]), np.array([[3, 0], [PAGES, PAGES]]), np.array([3, 0])
    jpools = Pools(*map(jnp.asarray, pools))
    bank = gather_bank(jpools, jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lengths), WIDTH)
    new_latent = rng.normal(size=bank.mla.latent.shape).astype(np.float32)
    new_state = rng.normal(size=bank.kda.state.shape).astype(np.float32)
    bank = bank._replace(mla=bank.mla._replace(latent=jnp.asarray(new_latent)),
                         kda=bank.kda._replace(state=jnp.asarray(new_state)))
    out = scatter_bank(jpools, jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lengths), bank, 2)
    expected = pages_of(pools.latent).copy()
    expected[0, 3, 3] = new_latent[0, 0, 3]          # position 3: page 3, row 3
    expected[0, 0, 0] = new_latent[0, 0, 4]          # position 4: page 0, row 0
    np.testing.assert_array_equal(pages_of(np.asarray(out.latent)), expected)
    expected_state = pools.state.copy()
    expected_state[1] = new_state[:, 0]
    np.testing.assert_array_equal(out.state, expected_state)   # the padding row wrote nothing


def test_the_paged_bank_gathers_kda_states_only_and_scatters_them_back():
    rng = np.random.default_rng(2)
    pools = random_pools(rng)
    slots, tables, lengths = np.array([2, SLOTS]), np.array([[4, 1], [PAGES, PAGES]]), np.array([6, 0])
    jpools = Pools(*map(jnp.asarray, pools))
    bank = paged_bank(jpools, jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lengths))
    np.testing.assert_array_equal(bank.kda.state[:, 0], pools.state[2])
    np.testing.assert_array_equal(bank.kda.conv[:, 1], 0)                       # the padding slot reads zeros
    assert isinstance(bank.mla, MLAPages)
    np.testing.assert_array_equal(bank.mla.latent, pools.latent)                # the pool itself, not a gather
    np.testing.assert_array_equal(bank.mla.tables, tables[None])
    np.testing.assert_array_equal(bank.mla.length, lengths[None])
    new_state = rng.normal(size=bank.kda.state.shape).astype(np.float32)
    new_latent = rng.normal(size=pools.latent.shape).astype(np.float32)
    bank = bank._replace(kda=bank.kda._replace(state=jnp.asarray(new_state)),
                         mla=bank.mla._replace(latent=jnp.asarray(new_latent)))
    out = scatter_paged(jpools, jnp.asarray(slots), bank)
    expected_state = pools.state.copy()
    expected_state[2] = new_state[:, 0]
    np.testing.assert_array_equal(out.state, expected_state)                    # the padding row wrote nothing
    np.testing.assert_array_equal(out.conv, pools.conv)
    np.testing.assert_array_equal(out.latent, new_latent)


def test_pieces_are_powers_of_two_that_never_cross_a_chunk_boundary():
    for start, stop in [(0, 40), (15, 40), (16, 17), (17, 33), (3, 4)]:
        pieces = piece_lengths(start, stop, 16)
        assert sum(pieces) == stop - start
        ends = start + np.cumsum(pieces)
        assert all(p & (p - 1) == 0 for p in pieces)
        assert all((end - p) // 16 == (end - 1) // 16 for end, p in zip(ends, pieces))
    assert piece_lengths(15, 40, 16) == [1, 16, 8]


def test_refcounts_free_an_id_with_its_last_holder():
    counts = RefCounts(2)
    a = counts.allocate()
    counts.share([a])
    counts.release([a])
    assert counts.in_use == 1 and counts.shared == 0
    counts.release([a])
    assert counts.in_use == 0
    counts.grow(4)
    assert sorted(counts.allocate() for _ in range(4)) == [0, 1, 2, 3]
