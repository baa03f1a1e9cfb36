//! Image prompts' three position streams and their rotation against `transformers` on the
//! `qwen3_5_moe` fixture's settings (`multimodal_positions_reference.json`, made by
//! `scripts/make_multimodal_position_reference.py`): `get_rope_index`'s positions and delta, and
//! the text rotary embedding's cos / sin at those positions applied by each backend's rope.
//! A text-only prompt's multimodal rotation is bit-identical to today's 1-D one.

use std::sync::Arc;

use ninfer_engine::backend::{Backend, MultimodalRotation, Rotation};
use ninfer_engine::testing::{golden_fixture_dir, json_numbers};
use ninfer_engine::vision::{multimodal_positions, ImageGrid};
use ninfer_engine::{test_device, CpuBackend};

fn reference() -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join("multimodal_positions_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("valid JSON")
}

struct Case {
    name: String,
    token_ids: Vec<u32>,
    grids: Vec<ImageGrid>,
    positions: [Vec<usize>; 3],
    delta: i64,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn cases(reference: &serde_json::Value) -> Vec<Case> {
    reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            let whole = |value: &serde_json::Value| -> Vec<usize> {
                json_numbers(value)
                    .into_iter()
                    .map(|v| v as usize)
                    .collect()
            };
            let rows = case["positions"].as_array().expect("three rows");
            Case {
                name: case["name"].as_str().expect("name").to_string(),
                token_ids: whole(&case["token_ids"])
                    .into_iter()
                    .map(|v| v as u32)
                    .collect(),
                grids: case["grids"]
                    .as_array()
                    .expect("grids")
                    .iter()
                    .map(|grid| {
                        let v = whole(grid);
                        ImageGrid {
                            temporal: v[0],
                            height: v[1],
                            width: v[2],
                        }
                    })
                    .collect(),
                positions: [whole(&rows[0]), whole(&rows[1]), whole(&rows[2])],
                delta: case["delta"].as_i64().expect("delta"),
                cos: json_numbers(&case["cos"])
                    .into_iter()
                    .map(|v| v as f32)
                    .collect(),
                sin: json_numbers(&case["sin"])
                    .into_iter()
                    .map(|v| v as f32)
                    .collect(),
            }
        })
        .collect()
}

fn section(reference: &serde_json::Value) -> [usize; 3] {
    let values = json_numbers(&reference["mrope_section"]);
    [values[0] as usize, values[1] as usize, values[2] as usize]
}

#[test]
fn positions_and_delta_equal_get_rope_index() {
    let reference = reference();
    let image_token = reference["image_token_id"].as_u64().expect("id") as u32;
    let merge = reference["spatial_merge_size"].as_u64().expect("merge") as usize;
    let cases = cases(&reference);
    assert_eq!(cases.len(), 4);
    for case in &cases {
        let ours = multimodal_positions(&case.token_ids, image_token, &case.grids, merge)
            .unwrap_or_else(|error| panic!("{}: {error}", case.name));
        for stream in 0..3 {
            let column: Vec<usize> = ours.streams.iter().map(|s| s[stream]).collect();
            assert_eq!(
                column, case.positions[stream],
                "{} stream {stream}",
                case.name
            );
        }
        assert_eq!(ours.delta, case.delta, "{}", case.name);
    }
}

#[test]
fn a_placeholder_run_that_does_not_fit_its_image_is_refused() {
    let grid = ImageGrid {
        temporal: 1,
        height: 4,
        width: 4,
    };
    // Four tokens fit a 4x4 grid at merge 2; three or five do not, nor a missing image.
    assert!(multimodal_positions(&[1, 9, 9, 9, 9, 2], 9, &[grid], 2).is_ok());
    assert!(multimodal_positions(&[1, 9, 9, 9, 2], 9, &[grid], 2).is_err());
    assert!(multimodal_positions(&[1, 9, 9, 9, 9, 9, 2], 9, &[grid], 2).is_err());
    assert!(multimodal_positions(&[1, 9, 9, 9, 9, 2], 9, &[], 2).is_err());
    assert!(multimodal_positions(&[1, 2], 9, &[grid], 2).is_err());
}

fn rope_turns_image_prompts_as_transformers_does<B: Backend>(backend: Arc<B>) {
    let reference = reference();
    let image_token = reference["image_token_id"].as_u64().expect("id") as u32;
    let merge = reference["spatial_merge_size"].as_u64().expect("merge") as usize;
    let rotary_dim = reference["rotary_dim"].as_u64().expect("rot") as usize;
    let theta = reference["rope_theta"].as_f64().expect("theta");
    let section = section(&reference);
    let head_dim = 2 * rotary_dim;
    for case in cases(&reference) {
        let rows = case.token_ids.len();
        let streams = multimodal_positions(&case.token_ids, image_token, &case.grids, merge)
            .expect("positions")
            .streams;
        let indices: Vec<usize> = (0..rows).collect();
        let values: Vec<f32> = (0..rows * head_dim)
            .map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let mut x = backend.upload(&values, rows, head_dim).expect("upload");
        let rotation = Rotation {
            positions: &indices,
            head_dim,
            rotary_dim,
            theta,
            multimodal: Some(MultimodalRotation {
                streams: &streams,
                section,
            }),
        };
        backend.rope(&mut x, &rotation).expect("rope");
        let ours = backend.download(&x).expect("download");
        let half = rotary_dim / 2;
        let mut largest = 0.0f32;
        for row in 0..rows {
            let input = &values[row * head_dim..(row + 1) * head_dim];
            let cos = &case.cos[row * rotary_dim..(row + 1) * rotary_dim];
            let sin = &case.sin[row * rotary_dim..(row + 1) * rotary_dim];
            for j in 0..half {
                let first = input[j] * cos[j] - input[j + half] * sin[j];
                let second = input[j + half] * cos[j + half] + input[j] * sin[j + half];
                largest = largest
                    .max((ours[row * head_dim + j] - first).abs())
                    .max((ours[row * head_dim + j + half] - second).abs());
            }
            // Past the rotary dims nothing turns.
            assert_eq!(
                ours[row * head_dim + rotary_dim..(row + 1) * head_dim],
                input[rotary_dim..]
            );
        }
        assert!(largest < 1e-5, "{}: max |Δ| {largest}", case.name);
    }
}

test_device!(rope_turns_image_prompts_as_transformers_does);

#[test]
fn text_positions_as_three_equal_streams_rotate_bit_identically() {
    let backend = CpuBackend::new();
    let (rows, head_dim, rotary_dim) = (37, 32, 8);
    let positions: Vec<usize> = (100..100 + rows).collect();
    let streams: Vec<[usize; 3]> = positions.iter().map(|&p| [p; 3]).collect();
    let values: Vec<f32> = (0..rows * head_dim)
        .map(|i| ((i * 7) % 23) as f32 / 11.0 - 1.0)
        .collect();
    let rotate = |multimodal: Option<MultimodalRotation<'_>>| {
        let mut x = backend.upload(&values, rows, head_dim).expect("upload");
        let rotation = Rotation {
            positions: &positions,
            head_dim,
            rotary_dim,
            theta: 10_000_000.0,
            multimodal,
        };
        backend.rope(&mut x, &rotation).expect("rope");
        backend.download(&x).expect("download")
    };
    let text = rotate(None);
    let multimodal = rotate(Some(MultimodalRotation {
        streams: &streams,
        section: [11, 11, 10],
    }));
    assert_eq!(
        text.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        multimodal.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_ne!(text, values, "the rotation did something");
}
