//! Publishing a group's assignment is a compare-and-set that holds across
//! processes: two stores with their own connection pools publish from the
//! same view at once, again and again, and exactly one wins each time.

use std::collections::BTreeMap;

use inbox_core::{MembershipStore, PartitionKey};
use inbox_postgres::{PgStore, TableName};
use inbox_testkit::pg::server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publications_from_one_view_have_one_winner() {
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let a = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    a.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let b = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for round in 0..100 {
        let previous = a
            .published_assignment("billing")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let proposal = |member: &str| -> BTreeMap<PartitionKey, String> {
            [(("orders".to_owned(), round), member.to_owned())].into()
        };
        let (mine, theirs) = (proposal("member-a"), proposal("member-b"));
        let (x, y) = tokio::join!(
            a.publish_assignment("billing", &previous, &mine),
            b.publish_assignment("billing", &previous, &theirs),
        );
        let (x, y) = (
            x.unwrap_or_else(|e| panic!("{e}")),
            y.unwrap_or_else(|e| panic!("{e}")),
        );
        let published = b
            .published_assignment("billing")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(x != y, "round {round}: both or neither won ({x}, {y})");
        assert_eq!(
            published,
            if x { mine } else { theirs },
            "round {round}: the winner's assignment is published, whole"
        );
    }
}
