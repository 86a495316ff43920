"""Communication graphs and mixing matrices for decentralized training.

A topology is a symmetric doubly stochastic mixing matrix W (N x N, non-negative, rows and
columns sum to 1, connected support graph). Client i averages with {j : W[i, j] > 0}.
Everything here is plain numpy/networkx so it can be imported (and tested) without torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import numpy as np

TOPOLOGIES = ("ring", "erdos_renyi", "complete_bipartite", "complete", "torus", "exponential")
WEIGHT_SCHEMES = ("metropolis_hastings", "uniform", "laplacian")


# -----------------------------------------------------------------------------
# graphs

def _torus_graph(n: int) -> nx.Graph:
    # the most square grid that tiles n exactly; n prime degenerates to 1 x n, i.e. a ring
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    cols = n // rows
    g = nx.Graph()
    g.add_nodes_from(range(n))
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            # nx.Graph merges the duplicate edges that appear when a side has length 2;
            # self-loops (side of length 1) are dropped by build_graph
            g.add_edge(i, r * cols + (c + 1) % cols)
            g.add_edge(i, ((r + 1) % rows) * cols + c)
    return g


def _exponential_graph(n: int) -> nx.Graph:
    g = nx.Graph()
    g.add_nodes_from(range(n))
    hop = 1
    while hop < n:
        for i in range(n):
            g.add_edge(i, (i + hop) % n)
            g.add_edge(i, (i - hop) % n)
        hop *= 2
    return g


def _erdos_renyi_graph(n: int, p: float, seed: int, max_tries: int) -> nx.Graph:
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    # resample with consecutive seeds so the result is still a pure function of `seed`
    for t in range(max_tries):
        g = nx.gnp_random_graph(n, p, seed=seed + t)
        if nx.is_connected(g):
            return g
    raise ValueError(
        f"erdos_renyi graph with n={n}, p={p} was not connected after {max_tries} tries "
        f"(seeds {seed}..{seed + max_tries - 1}); use a larger p "
        f"(connectivity needs roughly p > ln(n)/n = {math.log(n) / n:.3f}) or more max_tries"
    )


def build_graph(kind: str, n: int, *, p: float = 0.5, seed: int = 0, max_tries: int = 100) -> nx.Graph:
    """Undirected connected graph on nodes 0..n-1 without self-loops."""
    if kind not in TOPOLOGIES:
        raise ValueError(f"unknown topology {kind!r}; choose one of {', '.join(TOPOLOGIES)}")
    if n < 1:
        raise ValueError(f"number of clients n must be >= 1, got {n}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"edge probability p must be in (0, 1], got {p}")
    if kind == "ring":
        g = nx.cycle_graph(n)
    elif kind == "complete":
        g = nx.complete_graph(n)
    elif kind == "complete_bipartite":
        if n < 2:
            raise ValueError(f"complete_bipartite needs n >= 2, got {n}")
        g = nx.complete_bipartite_graph(n // 2, n - n // 2)  # nodes 0..n//2-1 form the first part
    elif kind == "erdos_renyi":
        g = _erdos_renyi_graph(n, p, seed, max_tries)
    elif kind == "torus":
        g = _torus_graph(n)
    else:
        g = _exponential_graph(n)
    # tiny rings/tori wrap onto themselves; a self-loop would count as a neighbor and break degrees
    g.remove_edges_from(list(nx.selfloop_edges(g)))
    return nx.Graph(g)  # plain Graph: drops the bipartite/generator-specific attributes


# -----------------------------------------------------------------------------
# weights

def mixing_weights(graph: nx.Graph, scheme: str = "metropolis_hastings") -> np.ndarray:
    """Symmetric doubly stochastic W supported on the edges of `graph` (nodes must be 0..n-1)."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r}; choose one of {', '.join(WEIGHT_SCHEMES)}")
    n = graph.number_of_nodes()
    if sorted(graph.nodes) != list(range(n)):
        raise ValueError("graph nodes must be labelled 0..n-1")
    A = nx.to_numpy_array(graph, nodelist=range(n), weight=None, dtype=np.float64)
    np.fill_diagonal(A, 0.0)
    A = (A > 0).astype(np.float64)
    deg = A.sum(axis=1)

    if scheme == "metropolis_hastings":
        W = A / (1.0 + np.maximum.outer(deg, deg))
        np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    elif scheme == "uniform":
        if A.sum() != n * (n - 1):
            raise ValueError(
                "uniform weights need the complete graph (every client talks to every other); "
                "use metropolis_hastings for other topologies"
            )
        W = np.full((n, n), 1.0 / n)
    else:
        # max-degree weights: each edge gets 1/(d_max+1), so w_ii = 1 - d_i/(d_max+1) >= 1/(d_max+1) > 0.
        # The "best constant" 2/(lambda_2 + lambda_N) of L can exceed 1/d_i and make diagonals negative.
        L = np.diag(deg) - A
        W = np.eye(n) - L / (deg.max(initial=0.0) + 1.0)
    return W


# -----------------------------------------------------------------------------
# validation, loading, spectrum

def validate_mixing_matrix(W, atol: float = 1e-9) -> np.ndarray:
    """Check that W is a symmetric doubly stochastic matrix with connected support; return a float64 copy."""
    try:
        W = np.array(np.asarray(W), dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"mixing matrix could not be converted to a float array: {e}") from e
    if W.ndim != 2 or W.shape[0] != W.shape[1] or W.shape[0] == 0:
        raise ValueError(f"mixing matrix must be 2-D, square and non-empty, got shape {W.shape}")
    n = W.shape[0]

    bad = np.argwhere(~np.isfinite(W))
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"mixing matrix must be finite: W[{i}, {j}] = {float(W[i, j])}")

    i, j = np.unravel_index(np.argmin(W), W.shape)
    if W[i, j] < 0:
        raise ValueError(f"mixing matrix must be non-negative: W[{i}, {j}] = {float(W[i, j])}")

    i, j = np.unravel_index(np.argmax(np.abs(W - W.T)), W.shape)
    if abs(W[i, j] - W[j, i]) > atol:
        raise ValueError(
            f"mixing matrix must be symmetric (atol={atol}): "
            f"W[{i}, {j}] = {float(W[i, j])} but W[{j}, {i}] = {float(W[j, i])}"
        )

    for axis, what in ((1, "row"), (0, "column")):
        sums = W.sum(axis=axis)
        k = int(np.argmax(np.abs(sums - 1.0)))
        if abs(sums[k] - 1.0) > atol:
            raise ValueError(f"mixing matrix {what}s must sum to 1 (atol={atol}): {what} {k} sums to {float(sums[k])}")

    support = nx.Graph()
    support.add_nodes_from(range(n))
    support.add_edges_from((int(a), int(b)) for a, b in np.argwhere(W > 0) if a < b)
    if not nx.is_connected(support):
        components = sorted(sorted(c) for c in nx.connected_components(support))
        raise ValueError(f"mixing matrix support graph of W is not connected: components {components}")
    return W


def load_mixing_matrix(path: str | os.PathLike) -> np.ndarray:
    """Read W from .json (nested list, or object with "W"/"mixing_matrix"), .csv or .npy, then validate."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".csv", ".npy"):
        raise ValueError(f"mixing matrix file {path}: unknown suffix {suffix!r}; use .json, .csv or .npy")
    if not path.is_file():
        raise ValueError(f"mixing matrix file {path} does not exist")
    try:
        if suffix == ".json":
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                key = next((k for k in ("W", "mixing_matrix") if k in data), None)
                if key is None:
                    raise ValueError('JSON object needs a "W" or "mixing_matrix" key')
                data = data[key]
            W = data
        elif suffix == ".csv":
            W = np.loadtxt(path, delimiter=",", ndmin=2)
        else:
            W = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"mixing matrix file {path} could not be parsed: {e}") from e
    try:
        return validate_mixing_matrix(W)
    except ValueError as e:
        raise ValueError(f"{e} (in file {path})") from e


def spectral_rho(W: np.ndarray) -> float:
    """rho = max(|lambda_2|, |lambda_N|)^2 of the symmetric W (paper Assumption 4.3); 0 for N = 1."""
    W = np.asarray(W, dtype=np.float64)
    if W.shape[0] == 1:
        return 0.0
    eig = np.linalg.eigvalsh(W)[::-1]  # descending, eig[0] = 1 for a doubly stochastic W
    return float(max(abs(eig[1]), abs(eig[-1])) ** 2)


# -----------------------------------------------------------------------------
# topology

@dataclass(frozen=True, eq=False)  # eq=False: elementwise array comparison has no single truth value
class Topology:
    W: np.ndarray
    name: str

    def __post_init__(self):
        W = validate_mixing_matrix(self.W)
        W.flags.writeable = False  # frozen means the matrix too
        object.__setattr__(self, "W", W)

    @property
    def n(self) -> int:
        return self.W.shape[0]

    def neighbors(self, i: int) -> list[int]:
        if not 0 <= i < self.n:
            raise IndexError(f"client {i} out of range for {self.n} clients")
        return [int(j) for j in np.flatnonzero(self.W[i] > 0) if j != i]

    @property
    def degrees(self) -> list[int]:
        return [len(self.neighbors(i)) for i in range(self.n)]

    @property
    def max_degree(self) -> int:
        return max(self.degrees)

    @property
    def rho(self) -> float:
        return spectral_rho(self.W)

    def describe(self) -> str:
        lines = [f"topology {self.name}: N={self.n} clients, rho={self.rho:.6f}, max degree {self.max_degree}"]
        for i in range(self.n):
            lines.append(f"  client {i}: self weight {self.W[i, i]:.4f}, neighbors {self.neighbors(i)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "n": self.n,
            "W": self.W.tolist(),
            "neighbors": [self.neighbors(i) for i in range(self.n)],
            "rho": self.rho,
        }


def make_topology(
    kind: str,
    n: int,
    *,
    weights: str = "metropolis_hastings",
    p: float = 0.5,
    seed: int = 0,
    max_tries: int = 100,
    matrix_file: str | None = None,
) -> Topology:
    """Topology from a generated graph, or from a user matrix when kind == "file" or matrix_file is given."""
    if kind == "file" or matrix_file is not None:
        if matrix_file is None:
            raise ValueError('topology "file" needs matrix_file')
        W = load_mixing_matrix(matrix_file)
        if W.shape[0] != n:
            raise ValueError(f"mixing matrix file {matrix_file} is for {W.shape[0]} clients but n={n}")
        return Topology(W=W, name=f"file:{matrix_file}")
    W = mixing_weights(build_graph(kind, n, p=p, seed=seed, max_tries=max_tries), weights)
    name = f"erdos_renyi(p={p},seed={seed})" if kind == "erdos_renyi" else kind
    if weights != "metropolis_hastings":
        name += f"[{weights}]"
    return Topology(W=W, name=name)
