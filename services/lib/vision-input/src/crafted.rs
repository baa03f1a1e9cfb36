//! Crafted hostile files for tests (here and in the servers that take images): headers that
//! claim sizes their few bytes do not hold. Nothing the pre-processing uses.

/// CRC-32 (IEEE), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut chunk = (data.len() as u32).to_be_bytes().to_vec();
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    chunk.extend_from_slice(&body);
    chunk.extend_from_slice(&crc32(&body).to_be_bytes());
    chunk
}

/// A PNG whose header claims `width × height` RGB pixels and whose pixel data is a few bytes
/// of a zlib stream that ends at once.
pub fn png_header_only(width: u32, height: u32) -> Vec<u8> {
    let mut header = width.to_be_bytes().to_vec();
    header.extend_from_slice(&height.to_be_bytes());
    header.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter quirks, no interlace
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(png_chunk(b"IHDR", &header));
    png.extend(png_chunk(
        b"IDAT",
        &[0x78, 0x9C, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    ));
    png.extend(png_chunk(b"IEND", &[]));
    png
}

/// A GIF whose logical screen and only frame claim `width × height` and that holds no pixels.
pub fn gif_header_only(width: u16, height: u16) -> Vec<u8> {
    let mut gif = b"GIF89a".to_vec();
    gif.extend_from_slice(&width.to_le_bytes());
    gif.extend_from_slice(&height.to_le_bytes());
    gif.extend_from_slice(&[0x80, 0, 0]); // a global colour table of 2 entries
    gif.extend_from_slice(&[0, 0, 0, 255, 255, 255]);
    gif.push(0x2C); // image descriptor
    gif.extend_from_slice(&[0, 0, 0, 0]);
    gif.extend_from_slice(&width.to_le_bytes());
    gif.extend_from_slice(&height.to_le_bytes());
    gif.push(0);
    gif.push(2); // LZW minimum code size, then no data: the file ends
    gif
}
