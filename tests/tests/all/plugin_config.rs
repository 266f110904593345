//! The config keys `docs/plugins.md` documents for each builtin plugin are
//! the keys the plugin accepts, checked through the runtime the node uses.
//!
//! Every builtin refuses, in its `open` / `configure`, a key it does not
//! know: `invalid`, naming the key and listing the keys it knows
//! (`unknown setting (known: ...)`). So for each builtin of the runtime's
//! list the test reads the doc's table of its keys (the first table under
//! the heading that names `builtin:NAME`) and
//!
//! 1. configures the plugin with every documented key, each at the table's
//!    example value (an address replaced by a real server's: redis-server,
//!    vineyardd in a private network namespace; `builtin:eic` opens the EIC
//!    test double driver), and checks that it opens: a documented key the
//!    plugin does not take, or an example it refuses, fails here;
//! 2. adds a key the doc does not list, and checks that the plugin refuses
//!    it naming it, and that the keys it says it knows are exactly the
//!    documented ones: a key the plugin takes and the doc leaves out fails
//!    here.
//!
//! The keys are not listed in this file: they come from the doc and from
//! the plugins' own refusals.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvplane_runtime::{Fault, KvError, LoadError, PluginDecl, PluginError, PluginRuntime, PluginSource, World};

/// Columns every table of builtin config keys has.
const COLUMNS: [&str; 5] = ["key", "type", "default", "example", "meaning"];
/// A key no builtin takes.
const UNDOCUMENTED: &str = "not-a-documented-key";

/// One documented key: its row, by column.
type Row = BTreeMap<String, String>;

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/plugins.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// A markdown table row's cells, trimmed.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().strip_prefix('|').and_then(|l| l.strip_suffix('|')).unwrap_or_else(|| panic!("not a table row: {line}"));
    inner.split('|').map(|c| c.trim().to_owned()).collect()
}

/// `text` without one pair of surrounding backticks.
fn code(text: &str) -> &str {
    text.strip_prefix('`').and_then(|t| t.strip_suffix('`')).unwrap_or(text)
}

/// The rows of the table of `builtin`'s config keys in `doc`, with every
/// column of [`COLUMNS`] filled in (a default may be empty only for a
/// family of keys, `driver.NAME`).
fn documented(doc: &str, builtin: &str) -> Vec<Row> {
    let tag = format!("`builtin:{builtin}`");
    let mut fenced = false;
    let lines: Vec<(bool, &str)> = doc
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
            }
            (fenced || l.trim_start().starts_with("```"), l)
        })
        .collect();
    let is_heading = |&(fenced, l): &(bool, &str)| !fenced && l.starts_with('#');
    let headings: Vec<usize> = (0..lines.len()).filter(|&i| is_heading(&lines[i]) && lines[i].1.contains(&tag)).collect();
    assert_eq!(headings.len(), 1, "docs/plugins.md: expected one heading naming {tag}, found {}", headings.len());
    let section = lines[headings[0] + 1..].iter().take_while(|l| !is_heading(l));
    let mut table = section.skip_while(|(f, l)| *f || !l.starts_with('|')).take_while(|(f, l)| !f && l.starts_with('|')).map(|(_, l)| *l);
    let header = cells(table.next().unwrap_or_else(|| panic!("docs/plugins.md: no table under the heading naming {tag}")));
    assert_eq!(header, COLUMNS, "docs/plugins.md: the table of {tag}'s keys has columns {header:?}, not {COLUMNS:?}");
    let rule = table.next().map(cells).unwrap_or_default();
    assert!(rule.iter().all(|c| c.starts_with("---")), "docs/plugins.md: {tag}: no |---| line under the header");
    let rows: Vec<Row> = table
        .map(|line| {
            let row = cells(line);
            assert_eq!(row.len(), COLUMNS.len(), "docs/plugins.md: {tag}: {line}");
            COLUMNS.iter().map(|c| c.to_string()).zip(row).collect()
        })
        .collect();
    assert!(!rows.is_empty(), "docs/plugins.md: the table of {tag}'s keys is empty");
    for row in &rows {
        for column in COLUMNS {
            let optional = column == "default" && is_family(key(row));
            assert!(optional || !row[column].is_empty(), "docs/plugins.md: {tag}: key {} has no {column}", row["key"]);
        }
    }
    rows
}

fn key(row: &Row) -> &str {
    code(&row["key"])
}

/// `driver.NAME`: a family of keys, whose last part the user picks.
fn is_family(key: &str) -> bool {
    key.ends_with(".NAME")
}

/// What a builtin needs around it to open with its documented config.
#[derive(Default)]
struct Setting {
    /// Values in place of the doc's examples (a real server's address).
    values: BTreeMap<&'static str, String>,
    /// One member of each family of keys (`driver.NAME`), as (key, value).
    family: BTreeMap<&'static str, (String, String)>,
    allowed_endpoints: Vec<String>,
    drivers: BTreeMap<String, PathBuf>,
}

/// The documented config of `builtin`: every key at its example value, or
/// at the one `setting` gives.
fn documented_config(builtin: &str, rows: &[Row], setting: &Setting) -> BTreeMap<String, String> {
    rows.iter()
        .map(|row| {
            let key = key(row);
            if is_family(key) {
                setting.family.get(key).cloned().unwrap_or_else(|| panic!("builtin:{builtin}: the test has no member of the family {key}"))
            } else {
                let value = setting.values.get(key).cloned().unwrap_or_else(|| code(&row["example"]).to_owned());
                (key.to_owned(), value)
            }
        })
        .collect()
}

/// Loads builtin `builtin` with `config` and runs its `open` / `configure`
/// on a fresh instance, as a node does before it serves.
async fn open(runtime: &PluginRuntime, builtin: &str, config: BTreeMap<String, String>, setting: &Setting) -> Result<(), PluginError> {
    let world = kvplane_runtime::builtin::world(builtin).unwrap_or_else(|| panic!("no world for builtin {builtin}"));
    let mut d = PluginDecl::new(builtin, world, PluginSource::Builtin(builtin.into()));
    d.config = config;
    d.allowed_endpoints = setting.allowed_endpoints.clone();
    d.drivers = setting.drivers.clone();
    match world {
        World::Backend => loaded(builtin, runtime.load_backend(d)).plugin.warm_up().await,
        World::KeyPlacement => loaded(builtin, runtime.load_key_placement(d)).plugin.warm_up().await,
        World::RetryPolicy => loaded(builtin, runtime.load_retry_policy(d)).plugin.warm_up().await,
        World::PlacementRule => loaded(builtin, runtime.load_placement_rule(d)).plugin.warm_up().await,
    }
}

/// A builtin always loads (it is the host's own component): only its
/// `open` / `configure` can refuse.
fn loaded<T>(builtin: &str, plugin: Result<T, LoadError>) -> T {
    plugin.unwrap_or_else(|e| panic!("loading builtin:{builtin}: {e}"))
}

/// Both checks of the module docs for `builtin`.
async fn documented_keys_are_what_it_takes(builtin: &str, setting: Setting) {
    let rows = documented(&doc(), builtin);
    let keys: BTreeSet<String> = rows.iter().map(|r| key(r).to_owned()).collect();
    let runtime = PluginRuntime::new(None).expect("creating the plugin runtime");

    let config = documented_config(builtin, &rows, &setting);
    if let Err(e) = open(&runtime, builtin, config.clone(), &setting).await {
        panic!("builtin:{builtin} does not open with every key docs/plugins.md documents ({config:?}): {e}");
    }

    let mut more = config;
    more.insert(UNDOCUMENTED.into(), "1".into());
    let refusal = match open(&runtime, builtin, more, &setting).await {
        Err(PluginError { fault: Fault::Configure(KvError::Invalid(message)), .. }) => message,
        Err(e) => panic!("builtin:{builtin} failed on the undocumented key {UNDOCUMENTED}, but not as an invalid config: {e}"),
        Ok(()) => panic!("builtin:{builtin} opened with the undocumented key {UNDOCUMENTED}: it ignores keys it does not know"),
    };
    assert!(refusal.contains(UNDOCUMENTED), "builtin:{builtin}'s refusal does not name the key: {refusal}");
    let known = refusal
        .split_once("(known: ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("builtin:{builtin}'s refusal does not list the keys it knows: {refusal}"));
    let known: BTreeSet<String> = known.split(',').map(|k| k.trim().to_owned()).collect();
    assert_eq!(
        known,
        keys,
        "builtin:{builtin} knows {:?} that docs/plugins.md does not document, and the doc has {:?} that it does not know",
        known.difference(&keys).collect::<Vec<_>>(),
        keys.difference(&known).collect::<Vec<_>>()
    );
}

#[test]
fn every_builtin_has_a_documented_table_of_keys() {
    let doc = doc();
    for builtin in kvplane_runtime::builtin::NAMES {
        documented(&doc, builtin);
    }
}

#[tokio::test]
async fn resp_takes_exactly_its_documented_keys() {
    // A server with the doc's example ACL user, so that `username` and
    // `password` are checked by a real AUTH at `open`.
    let rows = documented(&doc(), "resp");
    let example = |k: &str| rows.iter().find(|r| key(r) == k).map(|r| code(&r["example"]).to_owned());
    let user = example("username").unwrap_or_else(|| "kvplane".into());
    let password = example("password").unwrap_or_else(|| "s3cret".into());
    let redis = kvplane_tests::redis::RedisServer::start(&["--user", &user, "on", &format!(">{password}"), "~*", "&*", "+@all"]);
    let setting = Setting {
        values: BTreeMap::from([("endpoint", redis.endpoint())]),
        allowed_endpoints: vec![redis.endpoint()],
        ..Setting::default()
    };
    documented_keys_are_what_it_takes("resp", setting).await;
}

#[test]
fn vineyard_takes_exactly_its_documented_keys() {
    use kvplane_tests::vineyard::{in_private_network, VineyardServer};
    if !in_private_network(module_path!(), "vineyard_takes_exactly_its_documented_keys") {
        return;
    }
    println!("running inside a private network namespace");
    let server = VineyardServer::start();
    let setting = Setting {
        values: BTreeMap::from([("endpoint", server.endpoint())]),
        allowed_endpoints: vec![server.endpoint()],
        ..Setting::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(documented_keys_are_what_it_takes("vineyard", setting));
}

/// The EIC test double driver (`tests/fixtures/test-driver`), built once
/// per test process.
fn eic_test_driver() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugin-config-eic-test-driver");
        std::fs::create_dir_all(&dir).expect("creating the test driver's directory");
        kvplane_driver::test_support::build_eic_test_driver(&dir).expect("building the EIC test driver (a test double)")
    })
}

#[tokio::test]
async fn eic_takes_exactly_its_documented_keys() {
    let rows = documented(&doc(), "eic");
    // The driver is declared under the name the doc's example opens.
    let driver = rows.iter().find(|r| key(r) == "driver").map_or_else(|| "eic".to_owned(), |r| code(&r["example"]).to_owned());
    let setting = Setting {
        // The test double's own setting stands for a vendor's.
        family: BTreeMap::from([("driver.NAME", ("driver.max_bytes".to_owned(), "1048576".to_owned()))]),
        drivers: BTreeMap::from([(driver, eic_test_driver().to_owned())]),
        ..Setting::default()
    };
    documented_keys_are_what_it_takes("eic", setting).await;
}

#[tokio::test]
async fn ring_takes_exactly_its_documented_keys() {
    documented_keys_are_what_it_takes("ring", Setting::default()).await;
}

#[tokio::test]
async fn backoff_takes_exactly_its_documented_keys() {
    documented_keys_are_what_it_takes("backoff", Setting::default()).await;
}

#[tokio::test]
async fn gpu_affinity_takes_exactly_its_documented_keys() {
    documented_keys_are_what_it_takes("gpu-affinity", Setting::default()).await;
}
