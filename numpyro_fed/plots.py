"""Plots where people would rather look than read (matplotlib, imported on use)."""

from __future__ import annotations

import numpy as np

__all__ = ["plot_zigzag_trajectory"]


def plot_zigzag_trajectory(times, positions, *, coords=(0, 1), labels=None, ax=None, **line_kwargs):
    """Plots a Zig-Zag skeleton: the path is the straight line between switches.

    :param times: ``(n,)`` switching times (e.g. from :meth:`FedZigZag.skeleton`).
    :param positions: ``(n, d)`` positions at those times.
    :param coords: two coordinates: their joint path in the plane; one coordinate: its
        path against time.
    :param labels: axis labels for the coordinates.
    :param ax: a matplotlib axis (a new figure otherwise).
    :return: the axis.

    >>> import numpy as np
    >>> t = np.array([0.0, 1.0, 1.5]); x = np.array([[0.0, 0.0], [1.0, 1.0], [0.5, 1.5]])
    >>> ax = plot_zigzag_trajectory(t, x)
    >>> ax.get_lines()[0].get_xydata().tolist()
    [[0.0, 0.0], [1.0, 1.0], [0.5, 1.5]]
    """
    import matplotlib.pyplot as plt

    times, positions = np.asarray(times), np.asarray(positions)
    if positions.ndim != 2 or positions.shape[0] != times.shape[0]:
        raise ValueError(f"positions must have shape (len(times), d) = ({times.shape[0]}, d), got {positions.shape}")
    coords = tuple(np.atleast_1d(coords))
    if not 1 <= len(coords) <= 2 or max(coords) >= positions.shape[1]:
        raise ValueError(f"coords must name one or two of the {positions.shape[1]} coordinates, got {coords}")
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    labels = labels or [f"x[{c}]" for c in coords]
    line_kwargs.setdefault("lw", 0.8)
    if len(coords) == 2:
        ax.plot(positions[:, coords[0]], positions[:, coords[1]], **line_kwargs)
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
    else:
        ax.plot(times, positions[:, coords[0]], **line_kwargs)
        ax.set_xlabel("process time")
        ax.set_ylabel(labels[0])
    ax.set_title("Zig-Zag trajectory (switches joined by straight lines)")
    return ax
