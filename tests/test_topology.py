import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import deca_ds.topology as deca_ds_topology
from deca_ds.topology import (
    TOPOLOGIES,
    WEIGHT_SCHEMES,
    Topology,
    build_graph,
    load_mixing_matrix,
    make_topology,
    mixing_weights,
    spectral_rho,
    validate_mixing_matrix,
)


def _cases():
    for kind in TOPOLOGIES:
        for scheme in WEIGHT_SCHEMES:
            if scheme == "uniform" and kind != "complete":
                continue  # uniform weights exist only on the complete graph
            for n in range(2, 17):
                yield pytest.param(kind, scheme, n, id=f"{kind}-{scheme}-n{n}")


@pytest.mark.parametrize("kind,scheme,n", list(_cases()))
def test_every_kind_and_scheme_gives_a_valid_matrix(kind, scheme, n):
    g = build_graph(kind, n)
    topo = make_topology(kind, n, weights=scheme)
    W = topo.W
    assert W.dtype == np.float64 and W.shape == (n, n)
    assert np.all(W >= 0)
    assert np.allclose(W, W.T, rtol=0, atol=1e-12)
    assert np.abs(W.sum(axis=0) - 1).max() <= 1e-9
    assert np.abs(W.sum(axis=1) - 1).max() <= 1e-9
    assert nx.is_connected(g)
    assert sorted(g.nodes) == list(range(n)) and nx.number_of_selfloops(g) == 0
    # off-diagonal support is exactly the edge set; the self weight is positive in every scheme
    A = nx.to_numpy_array(g, nodelist=range(n), weight=None) > 0
    off = ~np.eye(n, dtype=bool)
    assert np.array_equal((W > 0) & off, A)
    assert np.all(np.diag(W) > 0)
    for i in range(n):
        assert topo.neighbors(i) == sorted(g.neighbors(i))
    assert topo.degrees == [g.degree(i) for i in range(n)]
    assert 0.0 <= topo.rho < 1.0
    validate_mixing_matrix(W)  # does not raise


@pytest.mark.parametrize("kind", [k for k in TOPOLOGIES if k != "complete_bipartite"])
def test_single_client_is_identity(kind):
    topo = make_topology(kind, 1)
    assert topo.W.tolist() == [[1.0]]
    assert topo.neighbors(0) == [] and topo.rho == 0.0


@pytest.mark.parametrize("kind", TOPOLOGIES)
@pytest.mark.parametrize("n", [33, 64])
def test_large_n(kind, n):
    topo = make_topology(kind, n)
    assert topo.n == n and 0.0 <= topo.rho < 1.0


def test_metropolis_hastings_matches_formula_on_hand_made_graph():
    # path 0-1-2 with an extra leaf 3 on node 1: degrees 1, 3, 1, 1
    g = nx.Graph([(0, 1), (1, 2), (1, 3)])
    F = Fraction
    expected = [
        [F(3, 4), F(1, 4), 0, 0],
        [F(1, 4), F(1, 4), F(1, 4), F(1, 4)],
        [0, F(1, 4), F(3, 4), 0],
        [0, F(1, 4), 0, F(3, 4)],
    ]
    assert np.allclose(mixing_weights(g), np.array(expected, dtype=float), rtol=0, atol=1e-15)
    # and a second shape where max(deg_i, deg_j) differs between edges: path 0-1-2-3 plus leaf 4 on 2
    g = nx.Graph([(0, 1), (1, 2), (2, 3), (2, 4)])  # degrees 1, 2, 3, 1, 1
    expected = np.zeros((5, 5))
    for i, j, w in [(0, 1, F(1, 3)), (1, 2, F(1, 4)), (2, 3, F(1, 4)), (2, 4, F(1, 4))]:
        expected[i, j] = expected[j, i] = w
    for i, d in enumerate([F(2, 3), F(5, 12), F(1, 4), F(3, 4), F(3, 4)]):
        expected[i, i] = d
    assert np.allclose(mixing_weights(g), expected, rtol=0, atol=1e-15)


def test_laplacian_weights_are_max_degree_weights():
    g = nx.Graph([(0, 1), (1, 2), (1, 3)])  # d_max = 3 -> every edge 1/4
    W = mixing_weights(g, "laplacian")
    expected = np.array([[3, 1, 0, 0], [1, 1, 1, 1], [0, 1, 3, 0], [0, 1, 0, 3]]) / 4
    assert np.allclose(W, expected, rtol=0, atol=1e-15)


def test_named_shapes():
    ring = make_topology("ring", 8)
    assert ring.neighbors(0) == [1, 7]
    assert ring.degrees == [2] * 8 and ring.max_degree == 2
    assert make_topology("exponential", 8).neighbors(0) == [1, 2, 4, 6, 7]
    torus = build_graph("torus", 16)
    assert nx.is_isomorphic(torus, nx.grid_2d_graph(4, 4, periodic=True))
    assert all(d == 4 for _, d in torus.degree())
    assert nx.utils.edges_equal(build_graph("torus", 7).edges, build_graph("ring", 7).edges)
    assert nx.is_isomorphic(build_graph("torus", 6), nx.grid_2d_graph(2, 3, periodic=True))
    bip = build_graph("complete_bipartite", 5)
    parts = nx.bipartite.sets(bip)
    assert sorted(map(len, parts)) == [2, 3] and bip.number_of_edges() == 6
    assert build_graph("ring", 2).edges == nx.Graph([(0, 1)]).edges


def test_uniform_on_complete_graph():
    for n in (2, 5, 9):
        topo = make_topology("complete", n, weights="uniform")
        assert np.array_equal(topo.W, np.ones((n, n)) / n)
        assert abs(topo.rho) <= 1e-12


def test_uniform_rejected_off_complete_graph():
    with pytest.raises(ValueError, match="uniform weights need the complete graph.*metropolis_hastings"):
        make_topology("ring", 5, weights="uniform")


def test_rho_ring4_metropolis_hastings():
    topo = make_topology("ring", 4)
    assert np.allclose(topo.W[0], [1 / 3, 1 / 3, 0, 1 / 3], rtol=0, atol=1e-15)
    # eigenvalues 1/3 + 2/3 cos(2 pi k / 4) = {1, 1/3, 1/3, -1/3}
    assert topo.rho == pytest.approx(1 / 9, abs=1e-12)
    assert spectral_rho(np.eye(1)) == 0.0


def test_erdos_renyi_seeding():
    a = build_graph("erdos_renyi", 12, p=0.4, seed=3)
    b = build_graph("erdos_renyi", 12, p=0.4, seed=3)
    assert sorted(a.edges) == sorted(b.edges)
    edge_sets = {tuple(sorted(build_graph("erdos_renyi", 12, p=0.4, seed=s).edges)) for s in range(5)}
    assert len(edge_sets) > 1
    assert make_topology("erdos_renyi", 12, p=0.4, seed=3).name == "erdos_renyi(p=0.4,seed=3)"


def test_erdos_renyi_gives_up():
    with pytest.raises(ValueError, match=r"n=16, p=0\.01.*5 tries.*larger p"):
        build_graph("erdos_renyi", 16, p=0.01, seed=0, max_tries=5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown topology 'star'.*ring.*exponential"):
        build_graph("star", 4)
    with pytest.raises(ValueError, match="unknown weight scheme 'best'.*metropolis_hastings.*laplacian"):
        make_topology("ring", 4, weights="best")
    with pytest.raises(ValueError, match=">= 1"):
        build_graph("ring", 0)
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            build_graph("erdos_renyi", 4, p=p)
    with pytest.raises(ValueError, match="n >= 2"):
        build_graph("complete_bipartite", 1)


def test_bad_matrices_are_rejected():
    ok = np.full((2, 2), 0.5)
    with pytest.raises(ValueError, match=r"^mixing matrix must be 2-D.*\(2, 3\)"):
        validate_mixing_matrix(np.full((2, 3), 0.5))
    with pytest.raises(ValueError, match=r"^mixing matrix must be finite: W\[1, 0\] = nan"):
        validate_mixing_matrix([[0.5, 0.5], [float("nan"), 0.5]])
    with pytest.raises(ValueError, match=r"^mixing matrix must be non-negative: W\[0, 1\] = -0\.5"):
        validate_mixing_matrix([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ValueError, match=r"^mixing matrix must be symmetric.*W\[0, 1\] = 0\.6 but W\[1, 0\] = 0\.4"):
        validate_mixing_matrix([[0.4, 0.6], [0.4, 0.6]])
    with pytest.raises(ValueError, match=r"^mixing matrix rows must sum to 1.*row 0 sums to 0\.7"):
        validate_mixing_matrix([[0.5, 0.2], [0.2, 0.5]])
    disconnected = np.kron(np.eye(2), ok)
    with pytest.raises(ValueError,
                       match=r"^mixing matrix support graph of W is not connected: components \[\[0, 1\], \[2, 3\]\]"):
        validate_mixing_matrix(disconnected)
    with pytest.raises(ValueError, match="^mixing matrix could not be converted"):
        validate_mixing_matrix([[0.5, 0.5], [1.0]])


def test_column_sums_checked_after_symmetry():
    # rows sum to exactly 1, entries are symmetric within 0.08, but column 1 sums to 1.16
    W = np.array([[0.40, 0.38, 0.22], [0.30, 0.40, 0.30], [0.22, 0.38, 0.40]])
    assert np.allclose(W.sum(axis=1), 1.0)
    with pytest.raises(ValueError, match="symmetric"):
        validate_mixing_matrix(W)  # default atol: the symmetry check fires first
    with pytest.raises(ValueError, match=r"^mixing matrix columns must sum to 1.*column 1 sums to 1\.16"):
        validate_mixing_matrix(W, atol=0.1)


def test_validate_returns_float64_copy():
    W = np.full((2, 2), 0.5, dtype=np.float32)
    out = validate_mixing_matrix(W)
    assert out.dtype == np.float64 and out is not W
    out2 = validate_mixing_matrix(out)
    out2[0, 0] = 7.0
    assert out[0, 0] == 0.5


@pytest.mark.parametrize("form", ["json_list", "json_W", "json_mixing_matrix", "csv", "npy"])
def test_load_round_trip(tmp_path, form):
    W = make_topology("erdos_renyi", 7, seed=1).W
    if form == "csv":
        path = tmp_path / "w.csv"
        np.savetxt(path, W, delimiter=",", fmt="%.17g")
    elif form == "npy":
        path = tmp_path / "w.npy"
        np.save(path, W)
    else:
        path = tmp_path / "w.json"
        data = {"json_list": W.tolist(), "json_W": {"W": W.tolist()},
                "json_mixing_matrix": {"mixing_matrix": W.tolist()}}
        path.write_text(json.dumps(data[form]))
    assert np.array_equal(load_mixing_matrix(path), W)
    topo = make_topology("file", 7, matrix_file=str(path))
    assert topo.name == f"file:{path}" and np.array_equal(topo.W, W)


def test_load_bad_files(tmp_path):
    txt = tmp_path / "w.txt"
    txt.write_text("0.5,0.5\n0.5,0.5\n")
    with pytest.raises(ValueError, match="w.txt.*suffix"):
        load_mixing_matrix(txt)
    with pytest.raises(ValueError, match="missing.json"):
        load_mixing_matrix(tmp_path / "missing.json")
    garbage_json = tmp_path / "garbage.json"
    garbage_json.write_text("{not json")
    with pytest.raises(ValueError, match="garbage.json"):
        load_mixing_matrix(garbage_json)
    no_key = tmp_path / "nokey.json"
    no_key.write_text('{"matrix": [[1.0]]}')
    with pytest.raises(ValueError, match="nokey.json"):
        load_mixing_matrix(no_key)
    garbage_csv = tmp_path / "garbage.csv"
    garbage_csv.write_text("a,b\nc,d\n")
    with pytest.raises(ValueError, match="garbage.csv"):
        load_mixing_matrix(garbage_csv)
    garbage_npy = tmp_path / "garbage.npy"
    garbage_npy.write_bytes(b"not an npy file")
    with pytest.raises(ValueError, match="garbage.npy"):
        load_mixing_matrix(garbage_npy)
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps([[0.5, 0.5], [0.4, 0.6]]))
    with pytest.raises(ValueError, match=r"^mixing matrix must be symmetric.*invalid\.json"):
        load_mixing_matrix(invalid)


def test_file_topology_arguments(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(np.full((3, 3), 1 / 3).tolist()))
    with pytest.raises(ValueError, match="3 clients but n=4"):
        make_topology("file", 4, matrix_file=str(path))
    with pytest.raises(ValueError, match="matrix_file"):
        make_topology("file", 3)


def test_topology_object():
    topo = make_topology("ring", 5)
    text = topo.describe()
    assert "rho" in text and "ring" in text
    for i in range(5):
        assert f"client {i}:" in text
    d = json.loads(json.dumps(topo.to_dict()))
    assert d["n"] == 5 and d["name"] == "ring" and d["neighbors"][0] == [1, 4]
    assert np.array_equal(np.array(d["W"]), topo.W) and d["rho"] == topo.rho
    with pytest.raises(ValueError):
        topo.W[0, 0] = 1.0  # read-only
    with pytest.raises(ValueError, match="not connected"):
        Topology(W=np.eye(2), name="bad")
    with pytest.raises(IndexError):
        topo.neighbors(5)


def test_module_does_not_pull_in_torch():
    # load topology.py on its own: the package __init__ imports torch-based modules
    path = Path(deca_ds_topology.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('topology', {str(path)!r})\n"
        "module = sys.modules['topology'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'topology.py imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
