-- Packets a client uploaded before it triggers (Trigger.dev's SDK sends a payload of 128 KiB or
-- more so: PUT /api/v2/packets/<name> answers a signed URL, the SDK PUTs the JSON there, then
-- triggers with payloadType "application/store" and the path). A trigger reads its packet by
-- (environment, path) and stores it as the run's payload; packets are deleted once they expire.
CREATE TABLE uploaded_packet (
    environment_id text NOT NULL REFERENCES runtime_environment(id) ON DELETE CASCADE,
    path text NOT NULL,
    content_type text NOT NULL,
    data text NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (environment_id, path)
);
CREATE INDEX uploaded_packet_expires ON uploaded_packet (expires_at);
