//! A byte-by-byte scan of a JSON request body as it arrives, measuring its large inputs without
//! keeping or parsing it.
//!
//! Owns: [`BodyScan`] and what it measures: the decoded bytes of the prompt text an endpoint's
//! JSON carries (message contents and their text parts, a completion prompt, a system prompt or
//! instructions), the model name, and [`InputSizes`] — tool definitions, token ids of a prompt,
//! stop sequences, `logit_bias` entries, document or image data (a video's frames included) and
//! the frames of the longest video. Chunking never changes a figure. The scan trusts the JSON to be well formed; a body that is not is refused by the
//! parser when nothing measured here refused it first.
//! Must not touch: the limits the figures are held to and the errors (`request_body`), what a
//! request means (handlers parse it).

/// Which JSON fields carry prompt text for an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFields {
    /// OpenAI chat: `messages[].content` (a string or text parts).
    Chat,
    /// OpenAI completions: `prompt` when it is one string.
    Completion,
    /// Anthropic messages: `system` and `messages[].content`.
    AnthropicMessages,
    /// OpenAI Responses: `instructions` and `input` (a string or items with content).
    Responses,
    /// Nothing is counted as prompt text (the other inputs still are).
    None,
}

impl PromptFields {
    pub fn for_path(path: &str) -> Self {
        match path {
            "/v1/chat/completions" => PromptFields::Chat,
            "/v1/completions" => PromptFields::Completion,
            "/v1/messages" => PromptFields::AnthropicMessages,
            "/v1/responses" => PromptFields::Responses,
            _ => PromptFields::None,
        }
    }

    /// Whether a string at `path` is text that goes into the prompt as it is.
    fn counts(self, path: &[Step]) -> bool {
        use Field::*;
        use Step::{Item, Key};
        // A message list's contents: a string, or text parts.
        let contents = |list: Field| {
            matches!(path, [Key(f), Item, Key(Content)] if *f == list)
                || matches!(path, [Key(f), Item, Key(Content), Item, Key(Text)] if *f == list)
        };
        match self {
            PromptFields::Chat => contents(Messages),
            PromptFields::Completion => matches!(path, [Key(Prompt)]),
            PromptFields::AnthropicMessages => {
                contents(Messages) || matches!(path, [Key(System)] | [Key(System), Item, Key(Text)])
            }
            PromptFields::Responses => {
                contents(Input) || matches!(path, [Key(Input)] | [Key(Instructions)])
            }
            PromptFields::None => false,
        }
    }
}

/// Sizes of a body's large inputs besides prompt text, so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InputSizes {
    /// Bytes of the top-level `tools` (and legacy `functions`) values as sent.
    pub tool_definition_bytes: usize,
    /// Numbers inside the top-level `prompt` (token-id prompts) or `tokens` (detokenize).
    pub token_ids: usize,
    /// Entries of the top-level `stop` / `stop_sequences` (a lone string is one).
    pub stop_sequences: usize,
    /// Bytes of those values as sent.
    pub stop_sequence_bytes: usize,
    /// Keys of the top-level `logit_bias` object.
    pub logit_bias_entries: usize,
    /// Decoded bytes of `data` / `file_data` strings, image URLs (`image_url`, `url`: data
    /// URLs carry the image) and a `video` part's frame URLs inside messages, input or system
    /// blocks (documents, images and video frames sent inline).
    pub document_bytes: usize,
    /// Frames of the `video` part with the most (each an entry of its `video` list).
    pub most_video_frames: usize,
}

/// The object keys the scan tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Messages,
    Content,
    Text,
    Prompt,
    System,
    Input,
    Instructions,
    Model,
    Tools,
    Functions,
    Tokens,
    Stop,
    StopSequences,
    LogitBias,
    Data,
    FileData,
    ImageUrl,
    Url,
    Video,
    Other,
}

impl Field {
    fn of_key(key: &[u8]) -> Field {
        match key {
            b"messages" => Field::Messages,
            b"content" => Field::Content,
            b"text" => Field::Text,
            b"prompt" => Field::Prompt,
            b"system" => Field::System,
            b"input" => Field::Input,
            b"instructions" => Field::Instructions,
            b"model" => Field::Model,
            b"tools" => Field::Tools,
            b"functions" => Field::Functions,
            b"tokens" => Field::Tokens,
            b"stop" => Field::Stop,
            b"stop_sequences" => Field::StopSequences,
            b"logit_bias" => Field::LogitBias,
            b"data" => Field::Data,
            b"file_data" => Field::FileData,
            b"image_url" => Field::ImageUrl,
            b"url" => Field::Url,
            b"video" => Field::Video,
            _ => Field::Other,
        }
    }

    /// Top-level fields whose whole value is measured in bytes.
    fn measured_whole(self) -> bool {
        matches!(
            self,
            Field::Tools | Field::Functions | Field::Stop | Field::StopSequences
        )
    }
}

/// One step of the path to a value: an object's field or an array's item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Key(Field),
    Item,
}

/// An open object or array.
#[derive(Debug, Clone, Copy)]
struct Container {
    is_object: bool,
    /// Objects: the field whose value comes next (or is being read).
    field: Field,
    /// Objects: a key is expected next (after `{` or `,`), not a value.
    expecting_key: bool,
}

/// Deeper bodies are not scanned further (serde refuses them anyway); nothing is counted.
const DEEPEST_SCANNED: usize = 64;
/// Longest key told apart, and longest model name kept.
const LONGEST_KEY: usize = 16;
const LONGEST_MODEL_NAME: usize = 256;

/// What the string being read is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StringRole {
    Key,
    CountedText,
    DocumentData,
    ModelName,
    Ignored,
}

/// A byte-by-byte JSON scan that counts the decoded bytes of prompt text (an escape counts as
/// one byte: a lower bound) and the [`InputSizes`] without keeping the body.
pub struct BodyScan {
    fields: PromptFields,
    stack: Vec<Container>,
    path: Vec<Step>,
    in_string: Option<StringRole>,
    /// 0: none; 1: after a backslash; 2..=5: hex digits of `\u` still to skip.
    escape: u8,
    /// Outside strings: the last significant byte opened a value slot (`[`, `,` or `:`), so a
    /// number or literal starting now is a new value.
    value_may_start: bool,
    key: Vec<u8>,
    model_name: Option<Vec<u8>>,
    prompt_bytes: usize,
    sizes: InputSizes,
    /// Bytes fed before the current chunk.
    consumed: usize,
    /// Frames of the `video` list being read.
    video_frames: usize,
    /// The top-level value being measured whole: its field and where it started.
    open_whole_value: Option<(Field, usize)>,
    /// Its bytes so far, up to the end of the last chunk (added to `sizes` when it ends).
    open_whole_bytes: usize,
    gave_up: bool,
}

impl BodyScan {
    pub fn new(fields: PromptFields) -> Self {
        BodyScan {
            fields,
            stack: Vec::new(),
            path: Vec::new(),
            in_string: None,
            escape: 0,
            value_may_start: false,
            key: Vec::new(),
            model_name: None,
            prompt_bytes: 0,
            sizes: InputSizes::default(),
            consumed: 0,
            video_frames: 0,
            open_whole_value: None,
            open_whole_bytes: 0,
            gave_up: false,
        }
    }

    /// Whether the figures mean anything (the body was followed to here).
    pub fn counting(&self) -> bool {
        !self.gave_up
    }

    /// Decoded bytes of prompt text so far (a lower bound).
    pub fn prompt_bytes(&self) -> usize {
        self.prompt_bytes
    }

    /// The `model` the body names, once read.
    pub fn model_name(&self) -> Option<&[u8]> {
        self.model_name.as_deref()
    }

    /// The other inputs' sizes so far, a value still arriving included.
    pub fn sizes(&self) -> InputSizes {
        let mut sizes = self.sizes;
        if let Some((field, _)) = self.open_whole_value {
            add_whole_value_bytes(&mut sizes, field, self.open_whole_bytes);
        }
        sizes
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        if self.gave_up {
            return;
        }
        let mut index = 0;
        while index < bytes.len() {
            if let Some(role) = self.in_string {
                // Fast path through ordinary string bytes.
                if self.escape == 0 {
                    let run = memchr::memchr2(b'"', b'\\', &bytes[index..])
                        .unwrap_or(bytes.len() - index);
                    self.take_string_bytes(role, &bytes[index..index + run], run);
                    index += run;
                    if index == bytes.len() {
                        break;
                    }
                }
                let byte = bytes[index];
                index += 1;
                match self.escape {
                    0 if byte == b'\\' => self.escape = 1,
                    0 => self.end_string(role),
                    1 => {
                        // One escaped character: at least one byte of text.
                        self.take_string_bytes(role, &[byte], 1);
                        self.escape = if byte == b'u' { 5 } else { 0 };
                    }
                    2 => self.escape = 0,
                    _ => self.escape -= 1,
                }
                continue;
            }
            let byte = bytes[index];
            let position = self.consumed + index;
            index += 1;
            match byte {
                b'{' | b'[' => {
                    if self.stack.len() >= DEEPEST_SCANNED {
                        self.give_up();
                        return;
                    }
                    self.enter_value(position);
                    if byte == b'[' && is_video_frame_list(&self.path) {
                        self.video_frames = 0;
                    }
                    self.stack.push(Container {
                        is_object: byte == b'{',
                        field: Field::Other,
                        expecting_key: byte == b'{',
                    });
                    self.value_may_start = byte == b'[';
                }
                b'}' | b']' => {
                    if self.stack.len() == 1 {
                        self.close_whole_value(position);
                    }
                    self.stack.pop();
                    self.path.pop();
                    self.value_may_start = false;
                }
                b':' => {
                    if let Some(top) = self.stack.last_mut() {
                        top.expecting_key = false;
                    }
                    self.value_may_start = true;
                }
                b',' => {
                    if self.stack.len() == 1 {
                        self.close_whole_value(position);
                    }
                    if let Some(top) = self.stack.last_mut() {
                        top.expecting_key = top.is_object;
                    }
                    self.value_may_start = true;
                }
                b'"' => {
                    self.value_may_start = false;
                    let role = match self.stack.last() {
                        Some(top) if top.is_object && top.expecting_key => {
                            self.key.clear();
                            if self.stack.len() == 2 && self.stack[0].field == Field::LogitBias {
                                self.sizes.logit_bias_entries += 1;
                            }
                            StringRole::Key
                        }
                        _ => {
                            self.enter_value(position);
                            self.count_value_start(false);
                            if self.fields.counts(&self.path) {
                                StringRole::CountedText
                            } else if self.path == [Step::Key(Field::Model)] {
                                self.model_name = Some(Vec::new());
                                StringRole::ModelName
                            } else if is_document_data(&self.path) {
                                StringRole::DocumentData
                            } else {
                                StringRole::Ignored
                            }
                        }
                    };
                    self.in_string = Some(role);
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => {
                    // A number or literal: only its first byte starts a value.
                    if self.value_may_start {
                        self.value_may_start = false;
                        self.enter_value(position);
                        self.count_value_start(true);
                    }
                }
            }
        }
        self.consumed += bytes.len();
        if let Some((_, start)) = self.open_whole_value {
            self.open_whole_bytes = self.consumed - start;
        }
    }

    fn give_up(&mut self) {
        self.gave_up = true;
    }

    /// A value starts in the innermost container: the path gains its step (replacing the
    /// previous sibling's); a top-level value measured whole starts here.
    fn enter_value(&mut self, position: usize) {
        let depth = self.stack.len();
        self.path.truncate(depth.saturating_sub(1));
        if let Some(top) = self.stack.last() {
            self.path.push(if top.is_object {
                Step::Key(top.field)
            } else {
                Step::Item
            });
            if depth == 1 && top.is_object && top.field.measured_whole() {
                self.open_whole_value = Some((top.field, position));
                self.open_whole_bytes = 0;
            }
        }
    }

    /// Counts the entries of the inputs limited by their number, at a value's start.
    fn count_value_start(&mut self, scalar: bool) {
        use Field::*;
        use Step::{Item, Key};
        match self.path.as_slice() {
            [Key(Prompt | Tokens), Item] | [Key(Prompt), Item, Item] if scalar => {
                self.sizes.token_ids += 1;
            }
            [Key(Stop | StopSequences)] | [Key(Stop | StopSequences), Item] if !scalar => {
                self.sizes.stop_sequences += 1;
            }
            [list @ .., Item] if !scalar && is_video_frame_list(list) => {
                self.video_frames += 1;
                self.sizes.most_video_frames = self.sizes.most_video_frames.max(self.video_frames);
            }
            _ => {}
        }
    }

    /// The top-level value measured whole ends before `position`.
    fn close_whole_value(&mut self, position: usize) {
        if let Some((field, start)) = self.open_whole_value.take() {
            add_whole_value_bytes(&mut self.sizes, field, position.saturating_sub(start));
            self.open_whole_bytes = 0;
        }
    }

    fn take_string_bytes(&mut self, role: StringRole, bytes: &[u8], decoded: usize) {
        match role {
            StringRole::CountedText => self.prompt_bytes += decoded,
            StringRole::DocumentData => self.sizes.document_bytes += decoded,
            StringRole::Key => {
                if self.key.len() <= LONGEST_KEY {
                    let room = LONGEST_KEY + 1 - self.key.len();
                    self.key.extend_from_slice(&bytes[..bytes.len().min(room)]);
                }
            }
            StringRole::ModelName => {
                if let Some(name) = self.model_name.as_mut() {
                    if name.len() <= LONGEST_MODEL_NAME {
                        name.extend_from_slice(bytes);
                    }
                }
            }
            StringRole::Ignored => {}
        }
    }

    fn end_string(&mut self, role: StringRole) {
        self.in_string = None;
        match role {
            StringRole::Key => {
                let field = Field::of_key(&self.key);
                if let Some(top) = self.stack.last_mut() {
                    top.field = field;
                }
            }
            // A string value ends: the next value of this container replaces its path step.
            _ => {
                if self.path.len() > self.stack.len().saturating_sub(1) {
                    self.path.truncate(self.stack.len().saturating_sub(1));
                }
            }
        }
    }
}

fn add_whole_value_bytes(sizes: &mut InputSizes, field: Field, bytes: usize) {
    match field {
        Field::Tools | Field::Functions => sizes.tool_definition_bytes += bytes,
        Field::Stop | Field::StopSequences => sizes.stop_sequence_bytes += bytes,
        _ => {}
    }
}

/// Inline data of a document, image or video frame: a `data` / `file_data` string, an image
/// URL or an entry of a `video` list somewhere inside the messages, input or system blocks
/// (Anthropic `source.data`, OpenAI `file.file_data`, `image_url.url` and `video[]`, Responses
/// `input_image.image_url`; a data URL holds the whole image, a link counts its few bytes).
fn is_document_data(path: &[Step]) -> bool {
    in_conversation(path)
        && (matches!(
            path.last(),
            Some(Step::Key(
                Field::Data | Field::FileData | Field::ImageUrl | Field::Url
            ))
        ) || matches!(path, [list @ .., Step::Item] if is_video_frame_list(list)))
}

/// A `video` value inside the messages or input: the list of a video part's frame URLs.
fn is_video_frame_list(path: &[Step]) -> bool {
    in_conversation(path) && path.last() == Some(&Step::Key(Field::Video))
}

fn in_conversation(path: &[Step]) -> bool {
    matches!(
        path.first(),
        Some(Step::Key(Field::Messages | Field::Input | Field::System))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanned(fields: PromptFields, body: &str, chunk: usize) -> BodyScan {
        let mut scan = BodyScan::new(fields);
        for piece in body.as_bytes().chunks(chunk.max(1)) {
            scan.feed(piece);
        }
        scan
    }

    #[test]
    fn counts_only_prompt_text_whatever_the_chunking() {
        let body = r#"{"model":"m1","tools":[{"content":"zzzz"}],"messages":[{"role":"user","content":"abc\"d\u00e9"},{"role":"assistant","content":[{"type":"text","text":"xy"},{"type":"image_url","image_url":{"url":"qqqq"}}]}],"stop":["0123456789"]}"#;
        for chunk in [1, 2, 3, 7, 1000] {
            let scan = scanned(PromptFields::Chat, body, chunk);
            // `abc\"d\u00e9`: 3 + 1 + 1 + 1 (an escape counts as one byte); `xy`: 2.
            assert_eq!(scan.prompt_bytes(), 8, "chunk {chunk}");
            assert_eq!(scan.model_name(), Some(&b"m1"[..]));
            assert!(scan.counting());
        }
    }

    #[test]
    fn each_endpoint_counts_its_own_fields() {
        let completion = r#"{"prompt":"hello","suffix":"zz","model":"m"}"#;
        assert_eq!(
            scanned(PromptFields::Completion, completion, 4).prompt_bytes(),
            5
        );
        let batch = r#"{"prompt":["hello","world"]}"#;
        assert_eq!(
            scanned(PromptFields::Completion, batch, 4).prompt_bytes(),
            0
        );
        let anthropic = r#"{"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"tool_result","content":"not counted"}]}]}"#;
        assert_eq!(
            scanned(PromptFields::AnthropicMessages, anthropic, 5).prompt_bytes(),
            5
        );
        let responses = r#"{"instructions":"be","input":[{"role":"user","content":[{"type":"input_text","text":"abc"}]}]}"#;
        assert_eq!(
            scanned(PromptFields::Responses, responses, 3).prompt_bytes(),
            5
        );
        assert_eq!(scanned(PromptFields::None, responses, 3).prompt_bytes(), 0);
    }

    #[test]
    fn measures_the_other_large_inputs_whatever_the_chunking() {
        let tools =
            r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#;
        let body = format!(
            r#"{{"model":"m","tools": {tools} ,"prompt":[1, 22,333,[4,5]],"stop":["ab","c\"d"],"logit_bias":{{"17":-100,"18":5,"19":{{"x":1}}}},"messages":[{{"role":"user","content":[{{"type":"document","source":{{"type":"base64","data":"QUJD"}}}},{{"type":"file","file":{{"file_data":"xy\n"}}}},{{"type":"image_url","image_url":{{"url":"data:,ab"}}}}]}}],"input":[{{"type":"input_image","image_url":"data:,c"}}],"url":"not inline","functions":[]}}"#
        );
        let stop = r#"["ab","c\"d"]"#;
        for chunk in [1, 2, 5, 13, 4096] {
            let sizes = scanned(PromptFields::Chat, &body, chunk).sizes();
            assert_eq!(
                sizes,
                InputSizes {
                    tool_definition_bytes: tools.len() + 2 + 1,
                    token_ids: 5,
                    stop_sequences: 2,
                    stop_sequence_bytes: stop.len(),
                    logit_bias_entries: 3,
                    document_bytes: 4 + 3 + 8 + 7,
                    most_video_frames: 0,
                },
                "chunk {chunk}"
            );
        }
        // A lone stop string is one entry; a value still arriving is counted so far.
        let lone = scanned(PromptFields::AnthropicMessages, r#"{"stop":"xyz"}"#, 3).sizes();
        assert_eq!((lone.stop_sequences, lone.stop_sequence_bytes), (1, 5));
        let arriving = r#"{"tools":[{"a":"bbbbbbbb"#;
        let measured = scanned(PromptFields::Chat, arriving, 4).sizes();
        assert_eq!(
            measured.tool_definition_bytes,
            arriving.len() - arriving.find('[').unwrap_or(0)
        );
        let detokenize = scanned(PromptFields::None, r#"{"tokens":[1,2,3]}"#, 2).sizes();
        assert_eq!(detokenize.token_ids, 3);
    }

    #[test]
    fn counts_video_frames_and_their_bytes_whatever_the_chunking() {
        // Two videos of 3 and 2 frames (one with an escape), beside an image; a `video` key
        // outside the conversation is not a video.
        let body = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"video","video":["data:,abc","data:,d\/e","data:,f"],"fps":2.0},{"type":"image_url","image_url":{"url":"data:,gh"}},{"type":"video","video":["data:,ij","data:,k"]}]}],"metadata":{"video":["zzzzzzzz","z","z","z"]}}"#;
        for chunk in [1, 2, 3, 7, 4096] {
            let sizes = scanned(PromptFields::Chat, body, chunk).sizes();
            assert_eq!(sizes.document_bytes, 9 + 9 + 7 + 8 + 8 + 7, "chunk {chunk}");
            assert_eq!(sizes.most_video_frames, 3, "chunk {chunk}");
        }
        let longest_last = r#"{"messages":[{"content":[{"type":"video","video":["a"]},{"type":"video","video":["b","c","d","e"]}]}]}"#;
        assert_eq!(
            scanned(PromptFields::Chat, longest_last, 5)
                .sizes()
                .most_video_frames,
            4
        );
    }
}
