//! The [`StoreWrite`] and [`StoreAdmin`] implementations: each call is one write transaction.

use super::*;

impl StoreWrite for Store {
    fn put_session(&self, ns: &Namespace, info: SessionInfo) -> Result<WriteReceipt> {
        self.write(|w| {
            let turn_count = w.session(ns, &info.id)?.map_or(0, |s| s.turn_count);
            w.put_session(ns, &SessionInfo { turn_count, ..info })
        })
        .map(|(_, r)| r)
    }

    fn add_turns(
        &self,
        ns: &Namespace,
        turns: Vec<(Turn, Option<Vec<f32>>)>,
    ) -> Result<WriteReceipt> {
        self.write(|w| {
            for (turn, vector) in turns {
                w.add_turn(ns, turn, vector.as_deref())?;
            }
            Ok(())
        })
        .map(|(_, r)| r)
    }

    fn commit_segment(&self, ns: &Namespace, write: SegmentWrite) -> Result<WriteReceipt> {
        self.write(|w| w.commit_segment(ns, write)).map(|(_, r)| r)
    }

    fn put_state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<WriteReceipt> {
        self.write(|w| w.put_state(ns, session, name, value))
            .map(|(_, r)| r)
    }

    fn log_usage(&self, ns: &Namespace, usage: &[TokenUsage]) -> Result<WriteReceipt> {
        self.write(|w| usage.iter().try_for_each(|u| w.log_usage(ns, u)))
            .map(|(_, r)| r)
    }

    fn set_vectors(&self, ns: &Namespace, items: &[(ItemRef, Vec<f32>)]) -> Result<usize> {
        self.write(|w| {
            let mut found = 0;
            for (item, v) in items {
                if w.set_item_vector(ns, item, v)? {
                    found += 1;
                }
            }
            Ok(found)
        })
        .map(|(n, _)| n)
    }
}

impl StoreAdmin for Store {
    fn export(
        &self,
        ns: &Namespace,
        out: &mut dyn std::io::Write,
        opts: crate::transfer::ExportOptions,
    ) -> Result<u64> {
        self.export_lines(ns, out, opts)
    }

    fn import(
        &self,
        ns: &Namespace,
        input: &mut dyn std::io::BufRead,
        embed: Option<&crate::transfer::EmbedFn>,
    ) -> Result<crate::transfer::ImportReceipt> {
        self.import_lines(ns, input, embed)
    }

    fn delete_record(&self, ns: &Namespace, record_id: &str) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_record(ns, record_id))
            .map(|(r, _)| r)
    }

    fn delete_session(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_session(ns, session))
            .map(|(r, _)| r)
    }

    fn clear_session_derived(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| w.clear_session_derived(ns, session))
            .map(|(r, _)| r)
    }

    fn delete_namespace(&self, ns: &Namespace) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_namespace(ns)).map(|(r, _)| r)
    }

    fn checkpoint(&self) -> Result<()> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        let mut vectors = self.vectors.write().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        self.checkpoint_locked(&mut vectors, &mut text)
    }
}

/// One process owns a store directory (its `LOCK` file), so the facade's in-process locks
/// already serialize everything: there is nothing more to hold.
impl crate::backend::StoreLocks for Store {
    fn lock(&self, _scope: crate::backend::LockScope<'_>) -> Result<crate::backend::LockGuard> {
        Ok(crate::backend::LockGuard::none())
    }

    fn try_lock(
        &self,
        _scope: crate::backend::LockScope<'_>,
    ) -> Result<Option<crate::backend::LockGuard>> {
        Ok(Some(crate::backend::LockGuard::none()))
    }
}

/// A setting as kept in the `info` table (key `setting:<name>`).
#[derive(serde::Serialize, serde::Deserialize)]
struct SettingRow {
    version: u64,
    value: serde_json::Value,
}

fn setting_row(raw: Option<&str>, name: &str) -> Result<Option<SettingRow>> {
    raw.map(|r| {
        serde_json::from_str(r)
            .map_err(|e| Error::Store(format!("setting {name} is unreadable: {e}")))
    })
    .transpose()
}

impl crate::backend::StoreSettings for Store {
    fn setting(&self, name: &str) -> Result<Option<(serde_json::Value, u64)>> {
        let txn = self.read()?;
        let info = txn.open_table(INFO).map_err(db_err)?;
        let raw = info
            .get(format!("setting:{name}").as_str())
            .map_err(db_err)?
            .map(|v| v.value().to_string());
        Ok(setting_row(raw.as_deref(), name)?.map(|r| (r.value, r.version)))
    }

    fn put_setting(
        &self,
        name: &str,
        value: &serde_json::Value,
        expected: Option<u64>,
    ) -> Result<u64> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        let txn = self.db.begin_write().map_err(db_err)?;
        let version = {
            let mut info = txn.open_table(INFO).map_err(db_err)?;
            let key = format!("setting:{name}");
            let raw = info
                .get(key.as_str())
                .map_err(db_err)?
                .map(|v| v.value().to_string());
            let current = setting_row(raw.as_deref(), name)?.map_or(0, |r| r.version);
            if let Some(expected) = expected
                && expected != current
            {
                return Err(crate::backend::setting_conflict(name, expected, current));
            }
            let row = SettingRow {
                version: current + 1,
                value: value.clone(),
            };
            let json = serde_json::to_string(&row)
                .map_err(|e| Error::Store(format!("setting {name}: {e}")))?;
            info.insert(key.as_str(), json.as_str()).map_err(db_err)?;
            row.version
        };
        txn.commit().map_err(db_err)?;
        Ok(version)
    }
}
