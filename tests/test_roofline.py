"""MoE-SpeQ's Amortization Roofline (specmoe.speculation.roofline, Sec. 3.2.1 Eq. 1): the
governor's Eq. 3 terms from C add up to its cycle time, and every coordinate of the roofline
equals a hand computation from those terms; the governor's pick is the k of highest modelled
throughput; the plot draws it."""
import math

import numpy as np
import pytest

from specmoe.speculation.controllers import Cascade, SpeqGovernor
from specmoe.speculation.roofline import amortization_roofline, plot_roofline


def _governor(t_first=0.004, io=(0.0, 0.006, 0.009, 0.011, 0.012, 0.014, 0.015)):
    # one observation at alpha = 1 makes the model exact (tests/test_spec.py's table): verify
    # 10 ms + 1 ms per token, 1 ms per draft token; acceptance 1, 1, 1, 0 on positions 1..4
    g = SpeqGovernor(k_max=6, alpha=1.0, p_init=0.5, t_first=t_first)
    g.observe(6, 3, 0.016, t_draft=0.006)
    g.set_io_cost(list(io))
    return g


def test_parts_add_up_to_the_cycle_time():
    g = _governor()
    for k in range(7):
        parts = g.model_parts(k)
        assert parts[1] == pytest.approx(0.004)                  # t_first, every k
        assert parts[3] == pytest.approx([0.0, 0.006, 0.009, 0.011, 0.012, 0.014, 0.015][k])
        assert sum(parts) == pytest.approx(g.model(k)[1])
    with pytest.raises(ValueError, match="speq_parts"):
        g.model_parts(7)
    with pytest.raises(ValueError):
        g.model_parts(-1)


def test_coordinates_equal_a_hand_computation():
    g, bw = _governor(), 2e9
    pts = amortization_roofline(g, bw)
    assert [p.k for p in pts] == list(range(7))
    for p in pts:
        e, t = g.model(p.k)
        d, f, v, io = g.model_parts(p.k)
        assert p.expected_tokens == pytest.approx(e) and p.cycle_s == pytest.approx(t)
        assert p.sync_bytes == pytest.approx(bw * (f + io))
        assert p.intensity == pytest.approx(e / (bw * (f + io)))          # Eq. 1, W = 1
        assert p.throughput == pytest.approx(e / t)                       # Eq. 2
        assert p.compute_roof == pytest.approx(e / (d + v))
        assert p.io_roof == pytest.approx(bw * p.intensity)               # slope BW / W
        assert p.attainable == pytest.approx(min(p.compute_roof, p.io_roof))
        assert p.throughput <= p.attainable + 1e-9    # in series never beats the overlap bound
    best = max(pts, key=lambda p: (p.throughput, -p.k))
    assert best.k == g.next_k()                                           # Eq. 4
    w2 = amortization_roofline(g, bw, work=2.0, ks=[2])
    assert len(w2) == 1 and w2[0].intensity == pytest.approx(2 * pts[2].intensity)


def test_without_synchronous_io_the_point_is_on_its_compute_roof():
    g = _governor(t_first=0.0, io=(0.0,) * 7)
    for p in amortization_roofline(g, 1e9):
        assert math.isinf(p.intensity) and math.isinf(p.io_roof)
        assert p.attainable == pytest.approx(p.compute_roof) == pytest.approx(p.throughput)
    with pytest.raises(ValueError, match="no point"):
        plot_roofline(amortization_roofline(g, 1e9), 1e9)


def test_bad_arguments():
    g = _governor()
    with pytest.raises(TypeError, match="SpeqGovernor"):
        amortization_roofline(Cascade(), 1e9)
    for bad in (0, -1.0, float("nan"), "1e9", True):
        with pytest.raises(ValueError, match="bandwidth"):
            amortization_roofline(g, bad)
    with pytest.raises(ValueError, match="work"):
        amortization_roofline(g, 1e9, work=0)


def test_plot_marks_the_governors_choice():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    g = _governor()
    pts = amortization_roofline(g, 2e9)
    ax = plot_roofline(pts, 2e9, chosen=g.next_k())
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"k={g.next_k()} (governor)" in labels and labels[0].startswith("I/O roof")
    x, y = ax.lines[0].get_data()                  # the I/O roof: y = BW * x (x per MB)
    assert np.allclose(y, 2e9 * x / 1e6)
    chosen = [ln for ln in ax.lines[1:] if ln.get_label().endswith("(governor)")]
    p = pts[g.next_k()]
    assert chosen[0].get_data()[0][0] == pytest.approx(p.intensity * 1e6)
    import matplotlib.pyplot as plt
    plt.close("all")
