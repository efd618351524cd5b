//! Issue 8, "Least-privilege roles": `setup --create-roles` (sql/roles.sql) makes a streamer
//! role that is no superuser yet runs the whole stream, and a producer role that can emit
//! through the helpers and do nothing else. (Every `Outbox::run` in the suite runs as the
//! streamer role; this module checks the roles themselves.)

use std::time::Duration;

use crate::support::fixture::{PRODUCER_ROLE, STREAMER_ROLE};
use crate::support::{scaled, Outbox, Postgres, RabbitMq};

/// `(rolsuper, rolreplication, rolcanlogin, rolcreaterole, rolcreatedb, rolbypassrls)`.
fn attributes(ob: &Outbox<'_>, role: &str) -> String {
    ob.sql(&format!(
        "SELECT concat_ws(',', rolsuper, rolreplication, rolcanlogin, rolcreaterole, rolcreatedb, rolbypassrls) FROM pg_roles WHERE rolname = '{role}'"
    ))
    .trim()
    .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streamer_is_no_superuser_and_the_producer_can_only_emit() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "roles").await;
    // rolsuper, rolreplication, rolcanlogin, rolcreaterole, rolcreatedb, rolbypassrls
    assert_eq!(attributes(&ob, STREAMER_ROLE), "f,t,t,f,f,f");
    assert_eq!(attributes(&ob, PRODUCER_ROLE), "f,f,f,f,f,f");
    // Member of nothing: its privileges are its own grants.
    assert_eq!(
        ob.sql(&format!(
            "SELECT count(*) FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member WHERE r.rolname IN ('{STREAMER_ROLE}', '{PRODUCER_ROLE}')"
        ))
        .trim(),
        "0"
    );

    // The producer emits through the helpers; it cannot read or write dead letters.
    let client = pg.client(&ob.db).await;
    client
        .batch_execute(&format!(
            "SET ROLE {PRODUCER_ROLE};
             SELECT outbox.emit('roles.json', '{{\"n\": 1}}', '{{}}', 'roles-1');
             SELECT outbox.emit_bytes('roles.bytes', '\\x00ff'::bytea, 'application/octet-stream', '{{}}', 'roles-2');
             RESET ROLE;"
        ))
        .await
        .expect("the producer role emits through outbox.emit and outbox.emit_bytes");
    for denied in [
        "SELECT count(*) FROM outbox.dead_letter",
        "INSERT INTO outbox.dead_letter (reason, envelope, lsn, commit_lsn, attempts) VALUES ('x', '', '0/1', '0/1', 1)",
        "DELETE FROM outbox.dead_letter",
    ] {
        client.batch_execute("RESET ROLE").await.unwrap();
        let e = client
            .batch_execute(&format!("SET ROLE {PRODUCER_ROLE}; {denied}"))
            .await
            .expect_err(denied);
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{denied}: {e:?}"
        );
    }
    client.batch_execute("RESET ROLE").await.unwrap();

    // The streamer role streams both messages (`run` connects as it), and the server says
    // so: its walsender and its SQL session belong to the streamer role.
    let streamer = ob.run(&["--instance-id", "roles"]);
    let got = ob.drain(2, scaled(Duration::from_secs(30))).await;
    let ids: Vec<_> = got.iter().filter_map(|m| m.message_id.as_deref()).collect();
    assert_eq!(ids, ["roles-1", "roles-2"], "{}", streamer.log());
    let users = ob.sql(
        "SELECT string_agg(DISTINCT usename::text || ':' || coalesce(backend_type, ''), ' ' ORDER BY usename::text || ':' || coalesce(backend_type, '')) FROM pg_stat_activity WHERE application_name LIKE 'pgoutbox-roles%' OR (backend_type = 'walsender' AND application_name LIKE 'pgoutbox%roles%')",
    );
    assert!(
        users.contains(&format!("{STREAMER_ROLE}:walsender"))
            && users.contains(&format!("{STREAMER_ROLE}:client backend")),
        "{users}\n{}",
        streamer.log()
    );
    let holder = ob.sql(&format!(
        "SELECT r.usename FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = '{}'",
        ob.slot
    ));
    assert_eq!(holder.trim(), STREAMER_ROLE);
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());

    // Idempotent: again, the roles exist and keep their attributes.
    let out = ob.cli(&["setup", "--create-roles", "--publication", &ob.publication]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "role {STREAMER_ROLE} (streamer role, LOGIN REPLICATION): existed"
        )) && stdout.contains(&format!(
            "role {PRODUCER_ROLE} (producer role, NOLOGIN): existed"
        )),
        "{stdout}"
    );
    assert_eq!(attributes(&ob, STREAMER_ROLE), "f,t,t,f,f,f");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_roles_takes_names() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "roles_named").await;
    let streamer = crate::support::unique("roles_s");
    let producer = crate::support::unique("roles_p");
    let out = ob.cli(&[
        "setup",
        "--create-roles",
        "--publication",
        &ob.publication,
        "--streamer-role",
        &streamer,
        "--producer-role",
        &producer,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "role {streamer} (streamer role, LOGIN REPLICATION): created"
        )),
        "{stdout}"
    );
    assert_eq!(attributes(&ob, &streamer), "f,t,t,f,f,f");
    assert_eq!(
        ob.sql(&format!(
            "SELECT has_table_privilege('{streamer}', 'outbox.dead_letter', 'INSERT'), has_table_privilege('{producer}', 'outbox.dead_letter', 'SELECT'), has_function_privilege('{producer}', 'outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text)', 'EXECUTE')"
        ))
        .trim(),
        "t|f|t"
    );
}
