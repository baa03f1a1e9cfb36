//! `ninfer bench sampling`: a row per sampling setting with its three timings; bad counts are
//! refused by name.

mod common;

#[test]
fn bench_sampling_reports_every_setting() {
    let stdout = common::ninfer_stdout(["bench", "sampling", "--vocab", "5000", "--draws", "3"]);
    let rows = common::table_rows(&stdout);
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in rows {
        let numbers: Vec<f64> = row
            .split(|c: char| c.is_whitespace() || c == '|')
            .filter_map(|field| field.parse().ok())
            .collect();
        // temperature, top-k, top-p, then six times in ms (best and median of three).
        assert_eq!(numbers.len(), 9, "{row}");
        assert!(
            numbers[3..].iter().all(|&ms| ms >= 0.0 && ms.is_finite()),
            "{row}"
        );
    }
}

#[test]
fn bench_sampling_refuses_zero_draws_by_name() {
    let stderr = common::ninfer_stderr_of_failure(["bench", "sampling", "--draws", "0"]);
    assert!(stderr.contains("--draws"), "{stderr}");
}
