//! The protocol-neutral message model: a message's headers and properties as
//! the engine sees them, whatever protocol published it.
//!
//! * `model`: [`Properties`], [`Table`], [`Value`];
//! * `encoding`: the engine's own binary encoding of [`Properties`] and the
//!   bounds-checked [`Reader`] every codec reads with;
//! * `codec`: header formats ([`HeaderFormat`]), their codecs
//!   ([`HeaderCodec`]) and the registry ([`HeaderCodecs`]);
//! * `lookup`: what routing sees of headers ([`HeaderLookup`],
//!   [`LazyLookup`], [`NoHeaders`]).
//!
//! # Raw bytes plus a format number
//!
//! A stored or queued message keeps its header as **raw bytes plus a
//! [`HeaderFormat`] number**, in whatever encoding its publisher's protocol
//! has: AMQP 0-9-1 keeps the basic property block exactly as the publisher
//! sent it (so an AMQP message delivered to an AMQP consumer is written to
//! the socket as the same bytes, never decoded or re-encoded), MQTT a compact
//! form of its publish flags and properties. The engine names only its own
//! format, [`HeaderFormat::WEIR`] ([`Properties`] in this module's encoding,
//! used by protocols with no header block worth keeping: HTTP, next the
//! native protocol).
//!
//! The engine never sees a wire format, so it cannot decode an AMQP block
//! itself: each adapter implements a [`HeaderCodec`] for its format, the
//! gateway's composition root registers them under their numbers in one
//! [`HeaderCodecs`] (`gateway/src/header_codecs.rs`), and the engine and the
//! adapters convert through it, never by matching on formats. A number is
//! never reused; a stored number without a registered codec reads back as
//! bytes and fails only to convert ([`PropertiesError::NoCodec`]).
//!
//! # How it is meant to be used
//!
//! * **Publish**: the adapter hands the engine its raw header and format
//!   (AMQP: the property block slice it already owns; MQTT: its compact
//!   header, built once).
//!   Nothing is decoded on publish unless a headers exchange asks
//!   ([`LazyLookup`] decodes once per publish, only the headers table, and
//!   only when a headers binding looks).
//! * **Store**: the record keeps the format byte ([`HeaderFormat::to_u8`])
//!   and the raw bytes. The store never interprets either.
//! * **Deliver**: the consumer's adapter asks for its own format.
//!   Same format: the raw bytes pass through ([`MessageHeader::encode_as`]
//!   returns the same `Bytes`, no copy). Another format: decode once to
//!   [`Properties`], encode once to the target; the registry's conversion
//!   cache ([`HeaderCodecs::convert_cached`]), keyed by (message id, target
//!   format), makes a message fanned out to many consumers of another
//!   protocol convert once, lazily, at its first delivery, not once per
//!   consumer.
//!
//! # Memory
//!
//! A queued message must not grow: `Message` should keep the format as one
//! flat `u8`-sized field next to `persistent` and `priority` (it fits in
//! their padding, so `size_of::<Message>()` is unchanged) and the raw bytes
//! in the `Bytes` it has today; a [`MessageHeader`] is built on demand (one
//! reference-count increment). The cache is bounded (a fixed number of
//! slots), never one entry per queued message.
//!
//! # Expiry
//!
//! AMQP's `expiration` is a relative TTL in milliseconds that RabbitMQ counts
//! per queue, from when the message entered it, and passes on unchanged to
//! consumers. MQTT 5's message expiry interval is a relative TTL in seconds
//! counted from publish, and a server must forward the interval *minus the
//! time the message waited*. So [`Properties`] keeps both: `ttl_ms` (relative,
//! as published) and `expires_at_ms` (an absolute deadline in ms since the
//! epoch, fixed when the message was accepted, by adapters whose protocol
//! counts from publish). [`Properties::deadline_ms`] combines them with the
//! entry's enqueue time.

mod codec;
mod encoding;
mod error;
mod lookup;
mod model;

pub use codec::{HeaderCodec, HeaderCodecs, HeaderFormat, MessageHeader, WeirCodec};
pub use encoding::{Reader, FORMAT_VERSION, MAX_DEPTH};
pub use error::PropertiesError;
pub use lookup::{HeaderLookup, LazyLookup, NoHeaders};
pub use model::{DeliveryMode, Properties, Table, Value};
