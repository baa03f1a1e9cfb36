//! Images in chat requests: each API's image part (an OpenAI or Responses data URL, an Anthropic
//! base64 source) becomes the encoded file the engine takes, checked from its header alone (the
//! format against the declared media type, the size within limits, a file cut short: each a 400
//! naming the problem), and each image's one `<|image_pad|>` of the rendered prompt becomes the
//! run of pad tokens the model's image processor gives it.
//!
//! The gateway never decodes pixels: the header says all the placeholder run needs, the engine
//! decodes (and refuses what only decoding shows), so a hostile image costs the gateway its
//! header and the request body it came in. An `http(s)` image URL is fetched only when the
//! operator allows its host (`image_urls`); the fetched file is then checked here like an
//! inline one.
//!
//! Owns: [`ChatImage`] (an image as a conversation carries it), [`ModelVision`] (what a served
//! model's images need: its processor settings and pad token) and the placeholder expansion.
//! Must not touch: the APIs' JSON shapes (each API reads its part and calls in here), decoding.

use base64::Engine as _;
use ninfer_protocol::v1::ImageInput;
use ninfer_vision_input::{
    probe_grid, probe_image, DecodeLimits, ImageProcessorSettings, VideoProcessorSettings,
    VisionInputError,
};

use crate::error::GatewayError;
use crate::tokenizer::ModelTokenizer;
use crate::videos::{ChatVideo, VideoFrame, VideoTokens};

/// The token each image's placeholder run is made of.
const IMAGE_PAD: &str = "<|image_pad|>";
/// The token a video's one placeholder is rendered as (and its frame pairs' runs are made of).
const VIDEO_PAD: &str = "<|video_pad|>";

/// One image of a conversation: its encoded file and the media type the client declared; or a
/// video, given as its frames (then `encoded` is empty).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatImage {
    pub encoded: Vec<u8>,
    /// Empty when the client declared none.
    pub media_type: String,
    pub video: Option<ChatVideo>,
}

impl ChatImage {
    /// An image from its file's bytes, refused (400 naming `where_`) when its header shows it
    /// is not an image the model can take.
    pub fn from_bytes(
        encoded: Vec<u8>,
        media_type: Option<&str>,
        where_: &str,
    ) -> Result<Self, GatewayError> {
        let media_type = media_type.unwrap_or_default().to_string();
        let declared = Some(media_type.as_str()).filter(|media| !media.is_empty());
        probe_image(&encoded, declared, &DecodeLimits::default())
            .map_err(|error| refusal(where_, &error))?;
        Ok(ChatImage {
            encoded,
            media_type,
            video: None,
        })
    }

    /// A video from its frames' URLs (each read as an image URL is) at `fps` frames a second
    /// (the model's video processor's rate when `None`), refused (400 naming `where_` and the
    /// frame) when a frame is not an image or the frames are too few, too many or of different
    /// sizes.
    pub fn video_from_urls(
        urls: &[&str],
        fps: Option<f64>,
        where_: &str,
    ) -> Result<Self, GatewayError> {
        ChatVideo::check_request(urls.len(), fps, where_)?;
        let frames = urls
            .iter()
            .enumerate()
            .map(|(index, url)| {
                let frame = Self::from_url(url, &format!("{where_}.video[{index}]"))?;
                Ok(VideoFrame {
                    encoded: frame.encoded,
                    media_type: frame.media_type,
                })
            })
            .collect::<Result<Vec<_>, GatewayError>>()?;
        Ok(ChatImage {
            encoded: Vec::new(),
            media_type: String::new(),
            video: Some(ChatVideo::new(frames, fps, where_)?),
        })
    }

    /// An image sent as base64 text (an Anthropic `base64` source).
    pub fn from_base64(
        data: &str,
        media_type: Option<&str>,
        where_: &str,
    ) -> Result<Self, GatewayError> {
        let encoded = decode_base64(data)
            .map_err(|problem| GatewayError::invalid(format!("{where_}: {problem}")))?;
        Self::from_bytes(encoded, media_type, where_)
    }

    /// An image sent as a URL: a `data:` URL carries the file; an `http(s)` URL is refused
    /// here (it is fetched, where the operator allows its host, before the images are taken).
    pub fn from_url(url: &str, where_: &str) -> Result<Self, GatewayError> {
        let trimmed = url.trim_start();
        let scheme = trimmed.split(':').next().unwrap_or_default();
        if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") {
            return Err(GatewayError::invalid(format!(
                "{where_}: image URLs are not fetched by this server; send the image inline as a data URL (data:image/png;base64,...)"
            )));
        }
        let Some(rest) = trimmed
            .get(..5)
            .filter(|head| head.eq_ignore_ascii_case("data:"))
            .and_then(|_| trimmed.get(5..))
        else {
            return Err(GatewayError::invalid(format!(
                "{where_}: an image URL must be a data URL (data:image/png;base64,...)"
            )));
        };
        let (header, data) = rest.split_once(',').ok_or_else(|| {
            GatewayError::invalid(format!("{where_}: the data URL has no `,` before its data"))
        })?;
        let mut parameters = header.split(';');
        let media_type = parameters.next().unwrap_or_default().trim();
        if !parameters.any(|parameter| parameter.trim().eq_ignore_ascii_case("base64")) {
            return Err(GatewayError::invalid(format!(
                "{where_}: the image data URL must be base64 (data:{media_type};base64,...)"
            )));
        }
        Self::from_base64(data, Some(media_type).filter(|m| !m.is_empty()), where_)
    }

    /// The image as the engine request carries it.
    pub fn engine_input(&self) -> ImageInput {
        if let Some(video) = &self.video {
            return video.engine_input();
        }
        ImageInput {
            encoded: self.encoded.clone(),
            media_type: self.media_type.clone(),
            frames: Vec::new(),
        }
    }
}

/// An image part as an API read it: the image, or why it cannot be one (raised only when the
/// model sees images; a text-only model gets its stand-in either way).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatImagePart {
    pub image: Result<ChatImage, String>,
    /// Where the part is in the request (`messages[1].content[0]`), for the refusal.
    pub location: String,
    /// The `http(s)` URL the image is at, until it is fetched (`image` then holds the refusal
    /// a server that fetches no URLs gives).
    pub fetch_from: Option<String>,
}

impl ChatImagePart {
    /// The part read from an image URL (OpenAI `image_url.url`, Responses `image_url`). A URL
    /// that is neither a data URL nor an `http(s)` one is malformed whatever the model (400).
    pub fn from_url(url: &str, location: String) -> Result<Self, GatewayError> {
        let scheme = url.trim_start().split(':').next().unwrap_or_default();
        if !["data", "http", "https"]
            .iter()
            .any(|known| scheme.eq_ignore_ascii_case(known))
        {
            return Err(GatewayError::invalid(format!(
                "{location}: an image URL must be a data URL (data:image/png;base64,...)"
            )));
        }
        let remote = scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https");
        Ok(ChatImagePart {
            image: ChatImage::from_url(url, &location).map_err(|error| error.to_string()),
            location,
            fetch_from: remote.then(|| url.trim().to_string()),
        })
    }

    /// The part read from a source that is only ever a remote URL (an Anthropic `url`
    /// source): `refusal` is what a server that fetches no URLs answers.
    pub fn from_remote_url(url: &str, refusal: String, location: String) -> Self {
        ChatImagePart {
            image: Err(refusal),
            location,
            fetch_from: Some(url.trim().to_string()),
        }
    }

    /// The part read from a video's frame URLs (an OpenAI `video` part; frames are data URLs).
    pub fn from_video_urls(urls: &[&str], fps: Option<f64>, location: String) -> Self {
        ChatImagePart {
            image: ChatImage::video_from_urls(urls, fps, &location)
                .map_err(|error| error.to_string()),
            location,
            fetch_from: None,
        }
    }

    /// The part read from base64 data (an Anthropic `base64` source).
    pub fn from_base64(data: &str, media_type: Option<&str>, location: String) -> Self {
        ChatImagePart {
            image: ChatImage::from_base64(data, media_type, &location)
                .map_err(|error| error.to_string()),
            location,
            fetch_from: None,
        }
    }

    /// A part that cannot be an image, with why.
    pub fn refused(problem: String, location: String) -> Self {
        ChatImagePart {
            image: Err(problem),
            location,
            fetch_from: None,
        }
    }

    /// What the part is, as templates and stand-ins name it: `video` or `image`.
    pub fn kind(&self) -> &'static str {
        match &self.image {
            Ok(image) if image.video.is_some() => "video",
            _ => "image",
        }
    }

    /// The image, or its refusal (400).
    pub fn image(&self) -> Result<&ChatImage, GatewayError> {
        self.image
            .as_ref()
            .map_err(|problem| GatewayError::invalid(problem.clone()))
    }
}

/// An image's refusal as the 400 every API gives (the problem named, after where it was).
fn refusal(where_: &str, error: &VisionInputError) -> GatewayError {
    GatewayError::invalid(format!("{where_}: {error}"))
}

/// Standard base64, padded or not; whitespace (line breaks some encoders insert) is skipped.
fn decode_base64(data: &str) -> Result<Vec<u8>, String> {
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let trimmed = compact.trim_end_matches('=');
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(trimmed)
        .map_err(|error| format!("the image data is not valid base64 ({error})"))
}

/// What a served model's images need: its image and video processors' settings and pad token,
/// and the tokens of a video's run where its tokenizer has them.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelVision {
    pub settings: ImageProcessorSettings,
    pub video_settings: VideoProcessorSettings,
    pub image_pad: u32,
    pub video: Option<VideoTokens>,
}

impl ModelVision {
    /// From the engine's model files: `None` for a model without a vision tower (no processor
    /// settings) or whose tokenizer has no `<|image_pad|>`. Without video processor settings
    /// (an engine that sends none) videos take the image processor's.
    pub fn from_model_files(
        preprocessor_config_json: &str,
        video_preprocessor_config_json: &str,
        tokenizer: &ModelTokenizer,
    ) -> Result<Option<Self>, GatewayError> {
        if preprocessor_config_json.is_empty() {
            return Ok(None);
        }
        let settings = ImageProcessorSettings::from_preprocessor_config(preprocessor_config_json)
            .map_err(|error| GatewayError::Internal(format!("the model's {error}")))?;
        let video_settings =
            match video_preprocessor_config_json {
                "" => VideoProcessorSettings::like_images(&settings),
                json => VideoProcessorSettings::from_video_preprocessor_config(json).map_err(
                    |error| GatewayError::Internal(format!("the model's video processor: {error}")),
                )?,
            };
        let video = match (
            tokenizer.token_to_id(VIDEO_PAD),
            tokenizer.token_to_id("<|vision_start|>"),
            tokenizer.token_to_id("<|vision_end|>"),
        ) {
            (Some(video_pad), Some(vision_start), Some(vision_end)) => Some(VideoTokens {
                video_pad,
                vision_start,
                vision_end,
            }),
            _ => None,
        };
        Ok(tokenizer
            .token_to_id(IMAGE_PAD)
            .map(|image_pad| ModelVision {
                settings,
                video_settings,
                image_pad,
                video,
            }))
    }

    /// The image tokens `image` takes in the prompt, from its header (as the processor sizes
    /// it).
    pub fn tokens_of(&self, image: &ChatImage, where_: &str) -> Result<usize, GatewayError> {
        let declared = Some(image.media_type.as_str()).filter(|media| !media.is_empty());
        let grid = probe_grid(
            &image.encoded,
            declared,
            &self.settings,
            &DecodeLimits::default(),
        )
        .map_err(|error| refusal(where_, &error))?;
        Ok(grid.merged_tokens(self.settings.merge_size))
    }

    /// `ids` with each image's one `<|image_pad|>` (the template renders one per image, in
    /// order) repeated to its image's token count, and each video's one `<|video_pad|>`
    /// replaced by its frame pairs' runs (their timestamps tokenized by `encode_text`).
    pub fn expand_placeholders(
        &self,
        ids: &[u32],
        images: &[ChatImage],
        encode_text: &dyn Fn(&str) -> Result<Vec<u32>, GatewayError>,
    ) -> Result<Vec<u32>, GatewayError> {
        let video_pad = self.video.map(|tokens| tokens.video_pad);
        let is_placeholder = |id: u32| id == self.image_pad || Some(id) == video_pad;
        let placeholders: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| is_placeholder(id))
            .collect();
        let expected: Vec<u32> = images
            .iter()
            .map(|image| match image.video {
                Some(_) => video_pad.unwrap_or(self.image_pad),
                None => self.image_pad,
            })
            .collect();
        if placeholders != expected {
            return Err(GatewayError::invalid(format!(
                "the rendered prompt has {} image or video placeholder(s) for {} image(s) and video(s) (they are taken in user messages and tool results only, and `{IMAGE_PAD}` or `{VIDEO_PAD}` must not be typed)",
                placeholders.len(),
                images.len()
            )));
        }
        let mut runs = Vec::with_capacity(images.len());
        for (index, image) in images.iter().enumerate() {
            runs.push(match (&image.video, self.video) {
                (Some(video), Some(tokens)) => video.placeholder_run(
                    &self.video_settings,
                    tokens,
                    encode_text,
                    &format!("video {}", index + 1),
                )?,
                (Some(_), None) => {
                    return Err(GatewayError::invalid(
                        "this model's tokenizer has no video placeholder tokens",
                    ))
                }
                (None, _) => {
                    let count = self.tokens_of(image, &format!("image {}", index + 1))?;
                    vec![self.image_pad; count]
                }
            });
        }
        let mut expanded = Vec::with_capacity(ids.len() + runs.iter().map(Vec::len).sum::<usize>());
        let mut runs = runs.into_iter();
        for &id in ids {
            match is_placeholder(id).then(|| runs.next()).flatten() {
                Some(run) => expanded.extend(run),
                None => expanded.push(id),
            }
        }
        Ok(expanded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1×1 PNG.
    const PIXEL_PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGM4wcUFAAJ6AN1nJ0J9AAAAAElFTkSuQmCC";

    #[test]
    fn data_urls_are_read_and_other_urls_refused() {
        let image = ChatImage::from_url(&format!("data:image/png;base64,{PIXEL_PNG}"), "here")
            .expect("a PNG data URL");
        assert_eq!(image.media_type, "image/png");
        assert_eq!(&image.encoded[1..4], b"PNG");
        let refused = |url: &str| {
            ChatImage::from_url(url, "messages[0].content[1]")
                .expect_err("refused")
                .to_string()
        };
        let fetched = refused("https://example.com/cat.png");
        assert!(fetched.contains("not fetched"), "{fetched}");
        assert!(fetched.starts_with("messages[0].content[1]"), "{fetched}");
        assert!(refused("ftp://example.com/cat.png").contains("must be a data URL"));
        assert!(refused("data:image/png,rawbytes").contains("must be base64"));
        assert!(refused("data:image/png;base64,%%%").contains("not valid base64"));
        let mislabelled = refused(&format!("data:image/jpeg;base64,{PIXEL_PNG}"));
        assert!(
            mislabelled.contains("declared as `image/jpeg`"),
            "{mislabelled}"
        );
        let svg = base64::engine::general_purpose::STANDARD
            .encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>");
        assert!(refused(&format!("data:image/svg+xml;base64,{svg}")).contains("image/svg+xml"));
    }

    fn no_text(_: &str) -> Result<Vec<u32>, GatewayError> {
        Ok(Vec::new())
    }

    #[test]
    fn each_placeholder_becomes_its_images_run() {
        let settings = ImageProcessorSettings {
            min_pixels: 1024,
            max_pixels: 4096,
            patch_size: 8,
            ..ImageProcessorSettings::default()
        };
        let vision = ModelVision {
            video_settings: VideoProcessorSettings::like_images(&settings),
            settings,
            image_pad: 7,
            video: None,
        };
        let image = ChatImage::from_base64(PIXEL_PNG, None, "image").expect("PNG");
        // 1×1 grows to the 1,024-pixel minimum: 32×32, 4×4 patches, 4 merged tokens.
        assert_eq!(vision.tokens_of(&image, "image").expect("sized"), 4);
        let expanded = vision
            .expand_placeholders(&[1, 7, 2, 7, 3], &[image.clone(), image.clone()], &no_text)
            .expect("expanded");
        assert_eq!(expanded, [1, 7, 7, 7, 7, 2, 7, 7, 7, 7, 3]);
        assert!(vision
            .expand_placeholders(&[1, 7, 2], &[], &no_text)
            .is_err());
        assert!(vision
            .expand_placeholders(&[1, 2], &[image], &no_text)
            .is_err());
    }
}
