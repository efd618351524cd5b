-- Example provisioning for platform teams (adapt names and passwords).
-- The streamer's role: REPLICATION to hold the slot; setup also needs CREATE on the database
-- (for the schema and the publication). Run `pgoutbox setup` as this role or as an owner.
CREATE ROLE pgoutbox LOGIN REPLICATION PASSWORD 'change-me';
GRANT CREATE ON DATABASE app TO pgoutbox;
-- Producers: after `pgoutbox setup` created schema outbox.
GRANT USAGE ON SCHEMA outbox TO app_writer;
