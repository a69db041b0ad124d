"""Progress off a terminal is a few plain lines, not a bar redrawn into the log (``make demo > log``)."""

import io

from tqdm.auto import tqdm

from hdreplay_lab.progress import LineProgress, progress


def test_off_a_terminal_progress_is_one_line_per_twentieth(capsys):
    bar = progress(total=1000, desc="2/3 runs", unit="step")
    assert isinstance(bar, LineProgress)
    for _ in range(1000):
        bar.update()
        bar.refresh()  # the pool refreshes every 2 s whether or not a step finished
    bar.close()
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 20 and "\r" not in out.out + out.err and not out.err
    assert lines[0].startswith("2/3 runs:   5% 50/1000 step") and lines[-1].startswith("2/3 runs: 100% 1000/1000")


def test_jumps_and_resumed_counts_print_once_per_crossing(capsys):
    bar = progress(total=100, initial=40, desc="runs", unit="step")
    for n in (40, 41, 41, 46, 46, 77, 77, 100):  # the multi-worker pool sets n from the runs' log lengths
        bar.n = n
        bar.refresh()
    bar.close()
    # a line when n passes the next multiple of 5 (of 100 / 20 lines), once; the 40 resumed steps print nothing
    assert [x.split()[2] for x in capsys.readouterr().out.splitlines()] == ["46/100", "77/100", "100/100"]


def test_iteration_lines_and_silence(capsys):
    assert list(progress(["a", "b", "c"], desc="calibration runs", unit="run")) == ["a", "b", "c"]
    assert len(capsys.readouterr().out.splitlines()) == 3
    for kw in ({"enabled": False}, {"lines": 0}):  # --no-progress; the report's seconds-long loops off a terminal
        assert list(progress(range(50), **kw)) == list(range(50))
        bar = progress(total=50, **kw)
        bar.update(50)
        bar.close()
    out = capsys.readouterr()
    assert out.out == out.err == ""


def test_on_a_terminal_it_is_a_tqdm_bar(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdout", Tty())
    monkeypatch.setattr("sys.stderr", Tty())
    bar = progress(total=10, desc="x")
    assert isinstance(bar, tqdm) and not isinstance(bar, LineProgress) and not bar.disable
    bar.close()
