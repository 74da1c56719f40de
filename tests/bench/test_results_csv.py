"""The benchmarks' CSV writer (ds_infcl/bench/results.py): header once, rows appended or the file
written anew, and the GPU name as a file-name tag."""

from ds_infcl.bench.results import file_tag, write_rows_csv


def test_a_new_file_gets_the_header_then_the_rows(tmp_path):
    path = tmp_path / "a.csv"
    write_rows_csv(str(path), [{"b": 1, "ms": 0.5}, {"b": 2, "ms": 1.25}])
    assert path.read_text() == "b,ms\n1,0.5\n2,1.25\n"  # header: the first row's keys, in order


def test_append_keeps_the_header_and_adds_rows(tmp_path):
    path = tmp_path / "a.csv"
    fields = ["ms", "b", "note"]
    write_rows_csv(str(path), [{"b": 1, "ms": 0.5, "note": ""}], fields, append=True)  # new file: header
    write_rows_csv(str(path), [{"b": 2, "ms": 3, "note": "x, y"}], fields, append=True)
    assert path.read_text() == 'ms,b,note\n0.5,1,\n3,2,"x, y"\n'


def test_without_append_the_file_is_written_anew(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("old,rows\n1,2\n")
    write_rows_csv(str(path), [{"b": 7}])
    assert path.read_text() == "b\n7\n"


def test_file_tag():
    assert file_tag("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert file_tag("  NVIDIA H200 (MIG 1g.18gb) ") == "nvidia_h200_mig_1g_18gb"
