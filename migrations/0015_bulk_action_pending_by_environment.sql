-- The actions under way of one environment (counted against its limit when one is made): the
-- reconciler's re-arm reads them all by id, a new action one environment's.
DROP INDEX bulk_action_pending;
CREATE INDEX bulk_action_pending ON bulk_action (environment_id, id) WHERE status = 'PENDING';
