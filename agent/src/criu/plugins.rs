//! Keeping CRIU's own plugins out of warmstart's dumps and restores.
//!
//! CRIU loads every `*.so` of its plugin directory (compiled in, `/usr/lib/criu/` unless built
//! otherwise, or `$CRIU_LIBS_DIR`, or a `libdir` line of any CRIU configuration file). A node
//! whose CRIU package ships `cuda_plugin.so` would then have CRIU lock, checkpoint, restore and
//! unlock the GPU state itself, without warmstart's GPU map and while warmstart expects to do it:
//! the restored process would come back running and be killed as half-restored. The RPC request
//! has no plugin-directory field, so every dump and restore names an agent-owned configuration
//! file (RPC `config_file`, read after every other configuration and the request itself) whose
//! only line points `libdir` at an agent-owned empty directory.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::error::CriuError;

/// Where the agent keeps CRIU's configuration file and empty plugin directory by default.
pub const DEFAULT_SETTINGS_DIR: &str = "/run/warmstart/criu";
/// The empty plugin directory, under the settings directory.
const PLUGINS: &str = "plugins";
/// The configuration file every dump and restore names, under the settings directory.
const CONFIG: &str = "rpc.conf";
/// CRIU's plugin directory when its `--help` does not name one (CRIU's own default).
pub const CRIU_BUILTIN_PLUGIN_DIR: &str = "/usr/lib/criu/";
/// The plugin CRIU ships for NVIDIA GPUs.
pub const CUDA_PLUGIN: &str = "cuda_plugin.so";

/// Makes sure `settings_dir` holds an empty plugin directory and a configuration file naming
/// it, and returns the configuration file's path.
///
/// # Errors
/// [`CriuError::PluginDir`] when either cannot be made, or the plugin directory holds anything
/// (warmstart never puts a file there: something else did, and CRIU would load it).
pub(crate) fn prepare(settings_dir: &Path) -> Result<PathBuf, CriuError> {
    let plugins = settings_dir.join(PLUGINS);
    let fail = |path: &Path, source: io::Error| CriuError::PluginDir {
        path: path.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .create(&plugins)
        .map_err(|e| fail(&plugins, e))?;
    let mut entries = std::fs::read_dir(&plugins).map_err(|e| fail(&plugins, e))?;
    if let Some(entry) = entries.next() {
        let name = entry.map_or_else(|e| e.to_string(), |e| e.path().display().to_string());
        return Err(fail(
            &plugins,
            io::Error::other(format!(
                "holds {name}: this directory must stay empty so that CRIU loads no plugin"
            )),
        ));
    }
    let config = settings_dir.join(CONFIG);
    let wanted = config_text(&plugins);
    if std::fs::read_to_string(&config).ok().as_deref() != Some(wanted.as_str()) {
        // Written aside and renamed: a concurrent request never reads half a file.
        let temp = settings_dir.join(format!(
            ".{CONFIG}.{}.{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&temp, &wanted)
            .and_then(|()| std::fs::rename(&temp, &config))
            .map_err(|e| {
                let _ = std::fs::remove_file(&temp);
                fail(&config, e)
            })?;
    }
    Ok(config)
}

/// The configuration file's text: CRIU reads one option per line, without the dashes.
fn config_text(plugins: &Path) -> String {
    format!("libdir {}\n", plugins.display())
}

/// CRIU's plugin directory when nothing overrides it, as its `--help` prints it
/// (`-L|--libdir ... (by default /usr/lib/criu/)`).
pub fn default_plugin_dir(criu: &Path) -> PathBuf {
    Command::new(criu)
        .arg("--help")
        .output()
        .ok()
        .and_then(|out| {
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            parse_default_dir(&text)
        })
        .unwrap_or_else(|| PathBuf::from(CRIU_BUILTIN_PLUGIN_DIR))
}

fn parse_default_dir(help: &str) -> Option<PathBuf> {
    let line = help.lines().find(|l| l.contains("--libdir"))?;
    let rest = line.split("by default").nth(1)?;
    let dir = rest.trim().trim_end_matches(')').trim();
    (!dir.is_empty()).then(|| PathBuf::from(dir))
}

/// The plugins (`*.so`) found in `dirs`, sorted.
pub fn installed(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|ext| ext == "so"))
        .collect();
    found.sort();
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_plugin_dir_is_read_from_criu_help() {
        let help = "  -L|--libdir           path to a plugin directory (by default /usr/local/lib/criu)\n  --timeout NUM  x\n";
        assert_eq!(
            parse_default_dir(help),
            Some(PathBuf::from("/usr/local/lib/criu"))
        );
        assert_eq!(parse_default_dir("no such line"), None);
        assert_eq!(
            default_plugin_dir(Path::new("/nonexistent/criu")),
            PathBuf::from(CRIU_BUILTIN_PLUGIN_DIR)
        );
    }

    #[test]
    fn the_settings_dir_gets_an_empty_plugin_dir_and_a_config_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let settings = dir.path().join("criu");
        let config = prepare(&settings).unwrap();
        let plugins = settings.join(PLUGINS);
        assert_eq!(
            std::fs::read_to_string(&config).unwrap(),
            format!("libdir {}\n", plugins.display())
        );
        assert!(std::fs::read_dir(&plugins).unwrap().next().is_none());
        // Idempotent, and nothing else is left behind.
        assert_eq!(prepare(&settings).unwrap(), config);
        assert_eq!(std::fs::read_dir(&settings).unwrap().count(), 2);
    }

    #[test]
    fn a_plugin_dropped_into_the_agents_plugin_dir_stops_the_request() {
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path()).unwrap();
        std::fs::write(dir.path().join(PLUGINS).join(CUDA_PLUGIN), b"x").unwrap();
        let err = prepare(dir.path()).unwrap_err();
        let text = crate::report::error_chain(&err);
        assert!(text.contains(CUDA_PLUGIN), "{text}");
        assert!(text.contains("must stay empty"), "{text}");
    }

    #[test]
    fn installed_plugins_are_listed_from_every_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CUDA_PLUGIN), b"").unwrap();
        std::fs::write(dir.path().join("README"), b"").unwrap();
        let found = installed(&[
            dir.path().to_owned(),
            dir.path().to_owned(),
            PathBuf::from("/nonexistent"),
        ]);
        assert_eq!(found, [dir.path().join(CUDA_PLUGIN)]);
    }
}
