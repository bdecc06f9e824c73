-- The metadata a run was triggered with, kept once anything replaces it (PUT …/metadata): a replay
-- starts with the metadata its run was triggered with (a trigger option, as Trigger.dev's
-- seedMetadata), not with what the run or anyone made of it since (its progress, its final state).
-- A one-element array holding that metadata (`[null]`: triggered without), written by the first
-- replacement; NULL while the metadata is still the trigger's (then the run's own is its seed), and
-- set back to NULL when a debounced trigger gives the run new metadata. Rows from before this column,
-- and replacements a process of the version before makes (a rolling upgrade), have NULL: a replay
-- of those takes the run's metadata, as before. Nullable, no default: no table rewrite.
ALTER TABLE task_run ADD COLUMN IF NOT EXISTS seed_metadata jsonb;
