"""benchmarks/loss_ab.py: two runs' losses side by side."""

from benchmarks import loss_ab


def test_loss_ab_reads_both_formats_and_judges_by_the_tolerance(tmp_path, capsys):
  a = tmp_path / "metrics.jsonl"
  a.write_text('{"step": 1, "loss": 8.0}\n{"step": 2, "loss": 7.5, "lr": 1}\n'
               '{"step": 2, "eval/loss": 7.9}\n')
  b = tmp_path / "step.json"
  b.write_text('[{"size": "s1", "losses": [9.0, 8.02, 7.5]}]')
  assert loss_ab.losses(str(a)) == {1: 8.0, 2: 7.5}
  assert loss_ab.losses(str(b)) == {0: 9.0, 1: 8.02, 2: 7.5}
  assert loss_ab.main([str(a), str(b), "--tolerance", "0.05"]) == 0
  out = capsys.readouterr().out
  assert "| 1 | 8.00000 | 8.02000 | -2.00e-02 | 0.32 |" in out and "over 2 steps" in out
  assert loss_ab.main([str(a), str(b), "--tolerance", "0.01"]) == 1
  c = tmp_path / "other.jsonl"
  c.write_text('{"step": 5, "loss": 1.0}\n')
  assert loss_ab.main([str(a), str(c)]) == 2
