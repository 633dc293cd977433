//! Every operation has a send span and a complete span named `epflow_op`, with the fields `op`,
//! `stage`, `tokens`, `bytes` and `micro_batch`; the complete span follows from the send span.

mod common;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{H, groups};
use epflow_core::HostTensor;
use epflow_core::ops::DispatchInputs;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

#[derive(Default)]
struct Seen {
    spans: HashMap<u64, (String, HashMap<String, String>)>,
    follows: Vec<(u64, u64)>,
}

#[derive(Clone, Default)]
struct Recorder {
    next: Arc<AtomicU64>,
    seen: Arc<Mutex<Seen>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}").trim_matches('"').to_string());
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.seen.lock().unwrap().spans.insert(id, (attrs.metadata().name().to_string(), fields));
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((_, fields)) = self.seen.lock().unwrap().spans.get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, span: &Id, follows: &Id) {
        self.seen.lock().unwrap().follows.push((span.into_u64(), follows.into_u64()));
    }
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn send_and_complete_spans_carry_the_fields() {
    let rec = Recorder::default();
    let gs = groups(1, common::config());
    tracing::subscriber::with_default(rec.clone(), || {
        futures::executor::block_on(async {
            let g = &gs[0];
            let idx = HostTensor::topk_idx(3, 2, vec![0, 1, 2, 3, 4, 5]);
            let h = g.create_handle(&idx).await.unwrap();
            let x = common::tokens(3, 1.0);
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).micro_batch(7).send_only().await.unwrap();
            let out = staged.await.unwrap();
            assert_eq!(out.counts().unwrap().iter().sum::<i32>(), 6);
        })
    });
    let seen = rec.seen.lock().unwrap();
    let ops: Vec<(&u64, &HashMap<String, String>)> =
        seen.spans.iter().filter(|(_, (name, _))| name == "epflow_op").map(|(id, (_, f))| (id, f)).collect();
    let send = ops.iter().find(|(_, f)| f.get("stage").map(String::as_str) == Some("send")).expect("a send span");
    let complete =
        ops.iter().find(|(_, f)| f.get("stage").map(String::as_str) == Some("complete")).expect("a complete span");
    assert_eq!(send.1.get("op").map(String::as_str), Some("dispatch #0"));
    assert_eq!(send.1.get("tokens").map(String::as_str), Some("3"));
    // One rank: 3 copies (one per token) of H BF16 channels.
    assert_eq!(send.1.get("bytes").map(String::as_str), Some((3 * H * 2).to_string().as_str()));
    assert_eq!(send.1.get("micro_batch").map(String::as_str), Some("7"));
    assert_eq!(complete.1.get("micro_batch").map(String::as_str), Some("7"));
    assert!(seen.follows.contains(&(*complete.0, *send.0)), "complete must follow from send: {:?}", seen.follows);
}
