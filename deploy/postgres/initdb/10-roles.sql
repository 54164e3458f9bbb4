-- Local stack only (docker-compose.yml): the roles of a least-privilege set-up.
-- Runs once, when the database volume is created, as the owner "outbox", which also
-- owns the outbox table (the `migrate` service). The GRANTs on the outbox itself are
-- printed by `outbox-relay grants` and applied by the `apply-grants` service.
-- In production create these roles with your usual tooling and real passwords.
CREATE ROLE outbox_relay LOGIN PASSWORD 'relay';        -- outbox-relay run
CREATE ROLE outbox_operator LOGIN PASSWORD 'operator';  -- status, dead, purge
CREATE ROLE outbox_writer LOGIN PASSWORD 'writer';      -- the application (enqueue)

-- The example application's own business table, owned like the rest by "outbox".
CREATE TABLE orders (
    id           uuid PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents integer NOT NULL,
    state        text NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT, UPDATE ON orders TO outbox_writer;
